"""The stage side: a stage server and the workers that carry out its lanes.

`StageServer` accepts connections, runs the handshake, parks return connections and runs one
compute at a time; each upstream lane is a `LaneWorker` that sees the server only through the
small `StageContext` protocol. Nothing here imports stage 0's driver (`stagerun._driver`).
"""
