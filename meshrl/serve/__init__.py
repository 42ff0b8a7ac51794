"""`meshrl serve`: a Tinker-protocol HTTP server over a meshrl training and sampling backend.

`app.build_app` is the FastAPI app; `runner.run_server` serves it with uvicorn. The pieces behind
it: `futures` (results the SDK polls for), `ordering` (a model's requests in `seq_id` order),
`training` and `sampling` (the backend's clients behind the SDK's ids), `catalogue` (model names
and aliases) and `wire` (protobuf and JSON conversions).
"""
