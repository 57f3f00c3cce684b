"""Measuring a real or emulated cluster and a model's ops, gathered in one package.

It sits above planner and runtime and below the face: it launches ranks (runtime), times the
ops of a captured graph (planner's capture, cost_models' free ops) and fits the cost formulas
(cost_models). Nothing below imports it.

  measure.py         sustained matmul rate, memory bandwidth, timing helpers
  op_profile.py      each op of a reference graph timed on this machine
  profiler.py        collectives and compute measured on every rank; alpha-beta fit
  profile_worker.py  one rank of `hetsynth profile` (torchrun entry)
  model_timing.py    the whole model timed on each emulated device (torchrun entry)
  measured.py        a captured graph with measured op times and device factors
"""
