"""What every section of the config schema (`dvi.config`) is built from: strict models, secrets, the error type."""

from __future__ import annotations

import hmac

from pydantic import BaseModel, ConfigDict, SecretStr

__all__ = ["ConfigError", "Secret"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and the key."""


class Secret(SecretStr):
    """A credential: prints and dumps as ``**********``; compares to its value in constant time.

    Equality with a plain ``str`` is allowed (constant time) so code and configs can check a
    presented token without ever handling the secret as an ordinary string.
    """

    def __eq__(self, other: object) -> bool:
        value = other.get_secret_value() if isinstance(other, SecretStr) else other
        if not isinstance(value, str):
            return False
        return hmac.compare_digest(value.encode("utf-8", "surrogatepass"),
                                   self.get_secret_value().encode("utf-8", "surrogatepass"))

    __hash__ = SecretStr.__hash__


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
