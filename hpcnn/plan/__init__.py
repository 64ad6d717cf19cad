"""Planning hybrid-parallel layouts without profiling (H. Wang's HSM2DL; docs/architecture.md).

The package owns three things:

- ``machine`` (and ``tables``, its checked piecewise tables): the hierarchical symmetric BSP
  machine (levels with fan-out, latency and a piecewise per-byte cost; a device's compute rates,
  memory bandwidth and capacity), read from and written to the TOML files under ``machines/``;
- ``calibrate``: what ``hpcnn calibrate --write`` times on the ranks at hand to write such a file
  (a package, one module per thing measured);
- ``cost`` and ``search``: the symbolic BSP cost of a block under a layout and the double
  recursive search over the bisections of the device set; ``hybrid``, ``auto`` and ``timeline``:
  a GPT's dp x tp x pp layouts priced, the one ``--plan=auto`` runs, a plan as a timeline;
  ``validation``: the layouts, logs and summaries of a validation against measured runs.

Nothing here imports MPI at module level: a plan is made on a laptop for a machine described by a
file; only ``calibrate`` talks to the communicator it is handed.
"""
