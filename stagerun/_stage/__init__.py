"""The stage side: a stage server and the workers that carry out its lanes.

`StageServer` accepts connections, runs the handshake, parks return connections and runs one
compute at a time; each upstream lane is a `LaneWorker` that sees the server only through the
small `StageContext` protocol. What one request holds on a stage, and the blocking compute it
runs, are `_session`'s. Nothing here imports stage 0's driver (`stagerun._driver`).
"""
