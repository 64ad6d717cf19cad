"""Memory saving: rotor's dynamic program (:mod:`.rotor`) and the offloading heuristic
(:mod:`.combine`) over a chain's profile (:mod:`.profile`), a sequence's cost (:mod:`.simulate`),
its execution with an exact memory account (:mod:`.executor`) and the offload channel
(:mod:`.offload`). The sequences themselves are data in :mod:`hpcnn.schedule.sequences`; the
``--remat`` policy that picks one per stage is :mod:`hpcnn.engine.remat`."""
