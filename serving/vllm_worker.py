"""Runs inside vLLM's workers, in vLLM's own venv: a worker extension (`--worker-extension-cls`) that replaces the
draft model's weights in place, reached from dvi through vLLM's `/collective_rpc` (`serving.vllm_engine`).

Imports nothing of dvi: vLLM's venv has torch, safetensors and vLLM, not dvi's dependencies. vLLM runs the call
between two of its engine steps, so a request in flight drafts with the old weights up to one step and the new
ones after it; none fails.
"""

from __future__ import annotations

import time


class DrafterReload:
    """Mixed into vLLM's worker class by vLLM (`worker_extension_cls`); `self` is the worker."""

    def dvi_reload_drafter(self, path: str) -> str:
        """Load the safetensors file `path` (checkpoint-format tensors of a Llama drafter: all of them, or only those
        that changed, e.g. a LoRA version's decoder layers) into the served draft model in place; the layers it does
        not name keep their weights. Returns a short report; raises on a name or shape vLLM does not take (dvi checks
        both first, and restarts vLLM if it raises anyway)."""
        import torch
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            raise RuntimeError("this vLLM serves no draft model (start it with a draft_model speculative config)")
        weights = load_file(path)
        with torch.no_grad():
            initialize_layerwise_reload(model)
            loaded = model.load_weights(iter(weights.items()))
            finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
            head = getattr(model, "lm_head", None)
            method = getattr(head, "quant_method", None)
            touches_head = any(k.startswith(("lm_head.", "model.embed_tokens.")) for k in weights)
            if touches_head and method is not None and hasattr(method, "process_weights_after_loading"):
                # the CPU backend packs the head's weight at load; a reload that leaves the packed copy serves the
                # old head (a version that changes only decoder layers leaves it as it is)
                method.process_weights_after_loading(head)
        if weights and not loaded:
            raise RuntimeError(f"the drafter took none of the {len(weights)} tensors in {path}")
        return f"loaded {len(weights)} tensors in {time.perf_counter() - t0:.3f}s"

    def dvi_reload_target(self, path: str) -> str:
        """Load the safetensors file `path` (every tensor of the target, checkpoint format) into the served target in
        place (vLLM's own layerwise reload); the caller then resets vLLM's prefix cache, which holds keys and values
        of the old weights."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        weights = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        return f"loaded {len(weights)} tensors in {time.perf_counter() - t0:.3f}s"
