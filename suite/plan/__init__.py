"""`suite plan`: a cost model of one training step under a parallel layout, and a search over layouts.

    layout.py       Job (what is trained, on what) and Layout (how): names, parsing, validity
    params.py       exact parameter counts per tensor, pipeline stage and rank
    memory.py       bytes per rank: weights, gradients, optimizer state (ZeRO stages, offload)
    activations.py  activation bytes per rank (Korthikanti et al. 2022), recompute, pp in-flight
    flops.py        FLOPs per step with recompute (Narayanan et al. 2021)
    comm.py         collective volumes and times on the links they cross
    cost.py         one layout's step: memory, time, tokens/s, TFLOP/s, MFU
    search.py       every valid layout of a world size, ranked
    report.py       the table, one layout's breakdown, JSON
    command.py      `suite plan` from a composed recipe; the smallest cluster when nothing fits
    dryrun.py       `suite pretrain --dry-run`: one rank placed on the meta device (fake process group)
    auto.py         `parallel=auto`: the fastest layout the trainer accepts for the launched world
    fit.py          `suite pretrain` stops a recipe that clearly cannot fit here, naming the cluster it needs
    published.py    the published runs the model is checked against (Narayanan et al. 2021, Table 2)

Pure arithmetic on the config (no tensors, no process group), so a 1024-GPU search runs on a laptop
in seconds. The formulas and their sources are in each function's docstring and docs/planner.md.
"""
