"""Stage 0, the driver: it runs every request, through its own engine and over lanes.

`stagerun._launch.open_pipeline`, a layer above, starts the stage processes or tasks (or joins
stages from a topology) and this package's pieces; `StageProcess` supervises a stage process;
`LanePool` keeps the persistent lanes; `Pipeline` runs requests on them: chunked
prefill, plain and speculative decoding, recovery. Decisions are taken by `stagerun._decide`;
this package carries them out.
"""
