"""What Feather measures, and how it writes it: ``stats`` (scheduler counts and the
``StepMeter`` that times passes and steps and saves the stats file), ``steplog`` (the
step log's columns, writer and reader), ``prometheus`` (the ``feather:`` series) and
``files`` (atomic replacement: no file Feather writes is ever left half-written).

The bottom of the package: imports nothing of Feather's outside itself.
"""
