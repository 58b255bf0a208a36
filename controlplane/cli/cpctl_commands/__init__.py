"""The `cpctl` commands, one module per command group (rollout.py is `cpctl rollout ...`),
beside command.py (how every command's parser is made, how it prints and fails) and client.py
(the gRPC client of the operator API, its token and its error lines). cpctl.py assembles them."""
