"""What every engine integration (:mod:`..transformers`, :mod:`..vllm`) shares, so that each engine package keeps
only what is specific to its engine (where it hooks, how its KV cache and batch map onto the runtime, its faults
and workloads):

* :mod:`.version` -- the version gate that refuses an engine release outside the tested range;
* :mod:`.state` -- the per-step side of a canary in an engine: violations read with their step and group, the
  health, status and drop tallies, the phase timer and the endpoint counters, the sweep over cached blocks;
* :mod:`.hooks` -- instance overrides set on the engine's objects and taken out again by ``remove()``;
* :mod:`.records` -- what ``kvcanary simulate --engine <engine>`` records: its configuration and its checks, one
  record per run and the whole simulation driven workload by workload;
* :mod:`.report` -- the report of such a simulation: the JSON-ready dict built from the records and its
  rendering (table, verdict, JSON and HTML files).

Nothing here imports an engine; the engine packages import these modules, never the other way round.
"""
