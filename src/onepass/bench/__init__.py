"""The benchmark behind ``onepass bench``: every setting timed side by side, in fresh processes.

    harness.py   settings, layouts, the timed training step in a subprocess, summaries
    trl.py       the TRL ``SFTTrainer`` baseline on the same N-pass views
    report.py    JSON, Markdown table and PNG plots
    cli.py       ``onepass bench``
    gpu_bundle.py / gpu_check.py   ``make gpu-bundle`` / ``make gpu-check``: the first GPU run, one call
    skyrl_step.py                  gpu-check's skyrl step (onepass's SkyRL forward, sharded as SkyRL shards it)
"""
