"""Both ends of a lane: framed streams, the handshake's I/O, authentication, dialling.

`FrameStream` carries whole frames over any transport's byte stream with a deadline on every
read and write; `client_handshake` / `server_handshake` run the sans-IO handshake of
`stagerun._proto` over it; `open_connection` dials a stage (its standbys too); `lane_secret`
finds the shared secret. Stage 0 and the stage server both build on this package, and neither
is imported here.
"""
