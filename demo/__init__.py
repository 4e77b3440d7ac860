"""`make demo` / `dvi demo`: the main job end to end, as a client of `dvi serve` (it stands above `serving/`)."""
