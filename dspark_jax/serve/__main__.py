"""Serve the engine over HTTP with the OpenAI API.

    python -m dspark_jax.serve                                  # SmolLM2 + the shipped drafter, dspark policy
    python -m dspark_jax.serve --policy none --port 8000 --num-slots 32 --api-key SECRET
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Binds 127.0.0.1 unless --host says otherwise. Requests carry their own temperature, top_p, seed, max_tokens,
stop and stop_token_ids (omitted temperature: --temperature, greedy by default). At most
--max-queued-requests wait for a slot (more get 429); a request that waited --queue-timeout seconds gets 503.
Clients are bounded: a body past --max-request-body-bytes gets 413, one slower than --request-body-timeout 408,
a connection without its headers after --request-header-timeout is closed, and past --max-connections
requests get 503. Ctrl-C (SIGINT) or SIGTERM stops taking requests and finishes those accepted.
"""

from __future__ import annotations

import argparse
import socket
import sys

from dspark_jax.build import add_engine_arguments, engine_from_args, load_target, target_name
from dspark_jax.cli import check_engine_arguments, nonnegative_float, port, positive_float, positive_int
from dspark_jax.serve.app import (DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT,
                                  DEFAULT_REQUEST_HEADER_TIMEOUT, DEFAULT_TIMEOUT_KEEP_ALIVE, create_app, server_config)
from dspark_jax.sharding import mesh_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port (0: any free one)")
    p.add_argument("--served-model-name", help="the model id clients pass (default: the model file or folder "
                                               "name without its extension)")
    p.add_argument("--num-slots", "--max-num-seqs", dest="num_slots", type=positive_int, default=16, help="requests decoded together")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=512,
                   help="longest prompt in tokens (sizes the cache; a longer one is refused with 400)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="the output budget of a request that gives no max_tokens (sizes the cache)")
    p.add_argument("--max-queued-requests", type=positive_int, default=256,
                   help="accepted requests that may wait for a slot; more are refused with 429")
    p.add_argument("--queue-timeout", type=nonnegative_float, default=600.0,
                   help="seconds a request may wait for a slot before it is refused with 503 (0: no limit)")
    p.add_argument("--max-request-body-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="largest request body; a larger one is refused with 413 before it is read (default: 16 MiB)")
    p.add_argument("--request-header-timeout", type=positive_float, default=DEFAULT_REQUEST_HEADER_TIMEOUT,
                   help="seconds a connection may take to send a request's headers before it is closed (default: 30)")
    p.add_argument("--request-body-timeout", type=nonnegative_float, default=DEFAULT_REQUEST_BODY_TIMEOUT,
                   help="seconds from a request's headers to the end of its body, else 408 (default: 60; 0: no limit)")
    p.add_argument("--timeout-keep-alive", type=positive_float, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                   help="seconds an idle kept-alive connection stays open (default: 5)")
    p.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections (or requests in flight) past which requests are answered 503 "
                        "(default: 512)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request but /health")
    p.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), e.g. http://localhost:3000, or '*' for "
                        "any (default: none, same-origin only)")
    p.add_argument("--warm-up", action="store_true",
                   help="compile every round program before serving (greedy and sampled; minutes on a CPU)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.api_key is not None and not args.api_key.strip():
        p.error("--api-key: expected a non-empty key (omit the option to serve without one)")
    try:
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        p.error(f"--host {args.host}: not an address this machine can bind ({e})")
    if (args.num_processes or 1) > 1 or args.coordinator_address:
        p.error("--num-processes / --coordinator-address: the server runs in one process, its engine on that "
                "process's devices (--tensor-parallel-size, --data-parallel-size); every process of a multi-process "
                "engine must be fed the same requests, which one HTTP front does not do")
    check_engine_arguments(p, args)
    import uvicorn  # noqa: PLC0415

    from dspark_jax.serve.worker import EngineWorker  # noqa: PLC0415

    try:
        mesh = mesh_from_args(args)
        model = load_target(args.model, dtype=args.dtype, mesh=mesh)
        engine = engine_from_args(args, model, num_slots=args.num_slots, max_prompt_tokens=args.max_prompt_tokens,
                                  max_new_tokens=args.max_new_tokens, mesh=mesh)
    except ValueError as e:
        build_parser().error(str(e))
    if model.tokenizer is None:
        build_parser().error("the model has no tokenizer; the server needs one for text and the chat template")
    name = args.served_model_name or target_name(args.model).rsplit(".gguf", 1)[0].split(".Q")[0]
    if args.warm_up:
        print(f"compiling the round programs for prompts up to {args.max_prompt_tokens} tokens ...", file=sys.stderr)
        engine.warm_up(args.max_prompt_tokens, sampled=True)
    worker = EngineWorker(engine, max_queued=args.max_queued_requests,
                          queue_timeout=args.queue_timeout or None)
    app = create_app(worker, model.tokenizer, name, api_key=args.api_key, default_max_tokens=args.max_new_tokens,
                     allowed_origins=args.allowed_origins, max_prompt_tokens=args.max_prompt_tokens,
                     max_request_body_bytes=args.max_request_body_bytes,
                     request_body_timeout=args.request_body_timeout or None)
    print(f"serving {name!r} (policy {engine.policy}, {args.num_slots} slots) on http://{args.host}:{args.port}",
          file=sys.stderr)
    server = uvicorn.Server(server_config(app, header_timeout=args.request_header_timeout,
                                          keep_alive=args.timeout_keep_alive, max_connections=args.max_connections,
                                          host=args.host, port=args.port, log_level="info",
                                          timeout_graceful_shutdown=600))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the server could not start (the port taken, ...)


if __name__ == "__main__":
    main()
