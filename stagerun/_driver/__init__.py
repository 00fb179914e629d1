"""Stage 0, the driver: it starts or joins the stages and runs every request.

`open_pipeline` (launch) starts stage processes or tasks, supervised, or joins stages from a
topology; `LanePool` keeps the persistent lanes; `Pipeline` runs requests on them: chunked
prefill, plain and speculative decoding, recovery. Decisions are taken by `stagerun._decide`;
this package carries them out.
"""
