"""``specdec serve``: load the target, build and start the serving engine, run uvicorn until Ctrl-C."""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import threading
import time

from ..errors import ConfigError


def check_serve_args(args) -> None:
    """Refuse bad server options before any model is loaded."""
    for name, v, lo in (("--port", args.port, 0), ("--max-slots", args.max_slots, 1),
                        ("--max-queue", args.max_queue, 0), ("--max-tokens", args.max_tokens, 1),
                        ("--max-body-bytes", args.max_body_bytes, 1024)):
        if v < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {v}")
    if args.max_context is not None and args.max_context < 2:
        raise ConfigError(f"--max-context must be >= 2, got {args.max_context}")
    if args.port > 65535:
        raise ConfigError(f"--port must be at most 65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key (or $SPECDEC_API_KEY) is empty")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def serve(args) -> int:
    check_serve_args(args)
    try:
        import uvicorn  # noqa: F401

        from .app import create_app  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"specdec serve needs the serve extra ({e.name} is missing): "
                          "pip install 'specdec[serve]'") from None
    if not is_loopback(args.host) and not args.api_key:
        print(f"specdec serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "port can use the model", file=sys.stderr)
    if args.tensor_parallel == 1:
        return _serve(None, args)
    from ..parallel.launch import run_parallel
    return run_parallel(_serve, args.tensor_parallel, args, device=args.device)


def _serve(shard, args) -> int:
    """Load the target (this rank's part of it under tensor parallelism) and serve it until
    Ctrl-C or SIGTERM. Rank 0 runs the HTTP server and the engine loop; other ranks follow that
    loop with no HTTP (:meth:`EngineLoop.follow`) and end when rank 0 stops it."""
    import uvicorn

    from ..api import default_model_path
    from ..engine.serve_loop import EngineLoop
    from ..loading import load_model
    from .app import create_app

    path = args.model or default_model_path()
    loaded = load_model(path, args.device if shard is None else shard.device, args.dtype, shard=shard)
    engine = EngineLoop(loaded, args.draft, max_slots=args.max_slots, max_queue=args.max_queue,
                        num_draft_tokens=args.num_draft_tokens, block_size=args.block_size,
                        draft_vocab=args.draft_vocab, max_context=args.max_context,
                        static_steps=False if args.no_cuda_graphs else None,
                        exact=False if args.no_exact_batching else None,
                        span_buckets=False if args.no_span_buckets or args.no_cuda_graphs else None)
    t0 = time.perf_counter()
    built = engine.warmup()  # the static steps before the first request (none under tensor parallelism)
    if built:
        print(f"specdec serve: {built} static steps built and checked in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    if shard is not None and shard.rank > 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 stops the others
        engine.follow()
        return 0
    name = args.served_model_name or os.path.basename(os.path.normpath(path))
    app = create_app(engine, loaded.tokenizer, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     max_tokens_limit=args.max_tokens)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    engine.start()
    if shard is not None:  # an engine that fails under tensor parallelism stops the server; the error follows
        threading.Thread(target=_stop_when_done, args=(engine, server), daemon=True).start()
    tp = "" if shard is None else f", tensor-parallel {shard.world}"
    print(f"specdec serve: {name} (draft {args.draft}{tp}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        server.run()
    finally:
        engine.stop()
    if shard is not None and engine.error is not None:  # not a user's error: a rank that died tells more
        raise RuntimeError(f"the serving loop stopped: {type(engine.error).__name__}: {engine.error}")
    return 0


def _stop_when_done(engine, server) -> None:
    engine.wait()
    server.should_exit = True
