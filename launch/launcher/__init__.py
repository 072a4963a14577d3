"""The launcher: the `scaleout` command line (`cli`) and what it drives.

    cli      verbs and their arguments
    sweep    the orchestrator: expand, check, write, run, report
    rundir   the run directory: one object with the run's identity, its cells, checkpoint places,
             ownership checks and writing
    inputs   the files a config names (token file, Hugging Face directory), checked before a run
    plan     what a cell would do, printed; nothing runs
    aot      plan --compile and the fit check: the real train step compiled or traced ahead of time
    status   status / logs / cancel of a run directory
    lock     one launcher per cell
"""
