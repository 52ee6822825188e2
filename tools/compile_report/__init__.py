"""The compiled-code report: every kernel launch slimformer makes, compiled for a GPU
without one, and what the compiled code costs (``python -m tools.compile_report``).

    cases.py     the shapes: realistic calls of slimformer's public ops
    capture.py   the launches those calls make on an emulated H100 / A100, without a GPU
    sass.py      a launch compiled by Triton and ptxas; registers, spills, SASS loops
    figures.py   estimates from the compiled code (issue, tensor-core and memory time)
    report.py    the command: select, capture, compile, write compile-<sm>.md and .png
    tutorial.py  the same measurement of Triton's tutorial attention, which the report quotes
"""
