"""The benchmark behind ``onepass bench``: every setting timed side by side, interleaved or in fresh processes.

    settings.py  the settings and the rows of each (numpy)
    harness.py   the timed training step, interleaved or in a subprocess, summaries
    trl.py       the TRL ``SFTTrainer`` baseline on the same N-pass views
    report.py    JSON, Markdown table and PNG plots
    cli.py       ``onepass bench``
    gpu_bundle.py / gpu_check.py   ``make gpu-bundle`` / ``make gpu-check``: the GPU run, one call
    gpu_plan.py / gpu_speed.py / gpu_probes.py   its speed plan, speed step and probes
    head_precision.py            the half-precision head's error against float64 (test and benchmark)
    skyrl_step.py                  gpu-check's skyrl step (onepass's SkyRL forward, sharded as SkyRL shards it)
"""
