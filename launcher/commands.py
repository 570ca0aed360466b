"""`shuttle serve` and `shuttle engine`: everything checked before a process starts (the model, ports, devices,
cores, flags that cannot be served here, one line and exit status 2 for each), each serving group's endpoints (ipc://
in a private runtime directory, tcp:// with CURVE, or tcp:// on the launcher's address for ranks on Ray's nodes), and
then the Launcher (launcher/launcher.py) that starts and supervises them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile

from shuttle.common.arg_types import chat_template_text
from shuttle.common.config import MODEL_SOURCE_ENV, IpcConfig, ShuttleConfig
from shuttle.common.cpu_threads import CoreError, allowed_cores, plan_cores
from shuttle.common.devices import DeviceError, auto_dtype_reason, cuda_device_count, resolve_config
from shuttle.common.errors import ModelDirError
from shuttle.common.generation_config import SamplingDefaults
from shuttle.common.ipc import CURVE_ENV
from shuttle.common.model_dir import check_model_dir
from shuttle.common.unix_socket import unix_socket_problem
from shuttle.frontend.observability.tracing import tracing_unavailable
from shuttle.launcher.launcher import Launcher, say
from shuttle.launcher.ports import Listen, PortError, check_ports, tcp_listen
from shuttle.launcher.ray_backend import RayPlacer, RayUnavailable, join_ray, model_source
from shuttle.launcher.scheduler_files import check_scheduler_files
from shuttle.launcher.supervised_unit import free_tcp_endpoints


def _say_auto_dtype(args: argparse.Namespace, config: ShuttleConfig) -> None:
    """Under --dtype auto, one line on the dtype it chose and why (common/devices.py)."""
    if getattr(args, "dtype", "auto") == "auto":
        say(f"dtype {auto_dtype_reason(config.worker.device)}")


def serve(args: argparse.Namespace) -> int:
    """Run `shuttle serve`. Returns the exit status: 0 after Ctrl-C/SIGTERM, 1 if the group could not be kept
    up, 2 on bad input."""
    if args.model_dir is None:
        print("shuttle: no MODEL_DIR given and the default ../shared/models/stories260K is missing", file=sys.stderr)
        return 2
    try:
        api_key = _api_key(args)
    except OSError as exc:
        print(f"shuttle: error: cannot read --api-key-file: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"shuttle: error: {exc}", file=sys.stderr)
        return 2
    remote = tuple(args.engine_endpoint or ())
    if args.data_parallel_size == 0 and not remote:
        print("shuttle: error: --data-parallel-size 0 needs at least one --engine-endpoint", file=sys.stderr)
        return 2
    # a name listed twice on /v1/models and in every 404; a group counted twice in /health and the router
    names = tuple(getattr(args, "served_model_name", None) or ())
    for flag, values in (("--served-model-name", names), ("--engine-endpoint", remote)):
        twice = next((v for v in values if values.count(v) > 1), None)
        if twice is not None:
            print(f"shuttle: error: {flag} {twice} is given twice", file=sys.stderr)
            return 2
    if any(e.startswith("tcp://") for e in remote) and not os.environ.get(CURVE_ENV):
        print(f"shuttle: error: a tcp:// --engine-endpoint needs the engine host's CURVE keys in ${CURVE_ENV} "
              f"(make them once with `shuttle curve-keys` and export them on both hosts)", file=sys.stderr)
        return 2
    unused = _ray_flags_unused(args)
    if unused:
        print(f"shuttle: error: {unused}", file=sys.stderr)
        return 2
    placer = None
    if args.distributed_executor_backend == "ray":
        if remote:
            print("shuttle: error: --engine-endpoint and --distributed-executor-backend ray do not go together: "
                  "under Ray the launcher places every serving group itself", file=sys.stderr)
            return 2
        try:
            host = join_ray(args.ray_address)
            placer = RayPlacer(args.ray_placement_strategy)
        except RayUnavailable as exc:
            print(f"shuttle: error: {exc}", file=sys.stderr)
            return 2
    try:
        return _serve(args, api_key, remote, placer, host if placer is not None else "")
    finally:
        if placer is not None:
            placer.close()


def _ray_flags_unused(args: argparse.Namespace) -> str | None:
    """Why Ray's placement flags would go unused on this command line (they need --distributed-executor-backend ray),
    else None: nothing is taken and ignored."""
    given = [flag for flag, value in (("--ray-address", args.ray_address),
                                      ("--ray-placement-strategy", args.ray_placement_strategy != "STRICT_PACK"))
             if value]
    if given and args.distributed_executor_backend != "ray":
        return f"{' and '.join(given)}: {'these place' if len(given) > 1 else 'it places'} serving groups on Ray, " \
               f"which needs --distributed-executor-backend ray"
    return None


def _serve(args: argparse.Namespace, api_key: str | None, remote: tuple[str, ...], placer: RayPlacer | None,
           host: str) -> int:
    """serve() once the serving groups' backend is known (`placer`: Ray's, with the launcher's node address `host`;
    None: local processes)."""
    runtime_dir = tempfile.mkdtemp(prefix="shuttle-")  # mode 0700: only this user reaches the sockets
    try:
        control = f"ipc://{runtime_dir}/control.sock"
        supervisor = f"ipc://{runtime_dir}/supervisor.sock"
        tp = getattr(args, "tensor_parallel_size", 1)
        if placer is not None:
            # the ranks on Ray's nodes reach the scheduler and the control socket over tcp:// on this node, with CURVE;
            # the frontend and the schedulers, here, keep ipc:// between them
            per_group = 2 + tp - 1
            control, *ports = free_tcp_endpoints(1 + args.data_parallel_size * per_group, host)  # all at once: distinct
            groups = []
            for g in range(args.data_parallel_size):
                plans, results, *rank_plans = ports[g * per_group:(g + 1) * per_group]
                local = IpcConfig.in_directory(runtime_dir, g, tp)
                groups.append(IpcConfig(local.requests, plans, results, control, supervisor, curve=True,
                                        rank_plans=tuple(rank_plans)))
        elif args.zmq_transport == "tcp":
            groups = []
            endpoints = free_tcp_endpoints(args.data_parallel_size * (3 + tp - 1))  # all at once: distinct ports
            for g in range(args.data_parallel_size):
                requests, plans, results, *rank_plans = endpoints[g * (3 + tp - 1):(g + 1) * (3 + tp - 1)]
                groups.append(IpcConfig(requests, plans, results, control, supervisor, curve=True,
                                        rank_plans=tuple(rank_plans)))
        else:
            groups = [IpcConfig.in_directory(runtime_dir, g, tp) for g in range(args.data_parallel_size)]
        base = groups[0] if groups else IpcConfig("", "", "", control, supervisor)
        curve = args.zmq_transport == "tcp" or placer is not None or any(e.startswith("tcp://") for e in remote)
        ipc = dataclasses.replace(base, curve=curve, group_requests=tuple(g.requests for g in groups),
                                  remote_groups=remote)
        try:
            check_model_dir(args.model_dir, tokenizer_dir=getattr(args, "tokenizer_dir", None))  # launcher/cli.py
            config = ShuttleConfig.from_args(args, ipc)
            # --device/--dtype/--attention-backend auto made concrete once; too few devices refused here
            # under Ray the devices are the cluster's GPUs
            devices = placer.cluster_gpus() if placer is not None and config.worker.device != "cpu" \
                else _cuda_devices(config)
            config = resolve_config(config, len(groups), devices)
            if placer is not None:
                placer.check_fits(config)
            check_scheduler_files(config.scheduler)
            if config.chat_template:
                _check_chat_template(config.chat_template)
            _check_tracing(config)
            check_ports(_frontend_listens(args, config) + ([] if placer else _rendezvous_listens(config, len(groups))))
            plan_cores(allowed_cores(), len(groups) * tp, config.worker.worker_cores)  # refuses a bad --worker-cores
        except (ModelDirError, PortError, DeviceError, CoreError, RayUnavailable) as exc:
            print(f"shuttle: error: {exc}", file=sys.stderr)
            return 2
        _say_auto_dtype(args, config)  # only once nothing is refused: a refusal is its one line alone
        _say_sampling_defaults(config.model.sampling_defaults)
        source = model_source(args.model_dir, args.model) if placer is not None else None
        if source:  # a Ray rank on a node without the snapshot fetches this very commit (worker/model_fetch.py)
            os.environ[MODEL_SOURCE_ENV] = source
        return Launcher(config, api_key, groups, placer=placer).run()
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _say_sampling_defaults(defaults: SamplingDefaults) -> None:
    """Name the request defaults that come from a generation_config.json (--generation-config), if any."""
    if defaults.source:
        named = ", ".join(f"{name}={value}" for name, value in defaults.named().items())
        say(f"request defaults from {defaults.source}: {named} (a request that sets one keeps its value; "
             f"--generation-config vllm ignores the file)")


def _check_tracing(config: ShuttleConfig) -> None:
    """Raise ModelDirError when --otlp-traces-endpoint is given and cannot be served here."""
    if config.observability.otlp_traces_endpoint:
        reason = tracing_unavailable()
        if reason:
            raise ModelDirError(reason)


def _check_chat_template(value: str) -> None:
    """Raise ModelDirError unless --chat-template `value` is a readable file or a template itself."""
    try:
        chat_template_text(value)
    except argparse.ArgumentTypeError as exc:
        raise ModelDirError(f"--chat-template: {exc}") from None


def engine(args: argparse.Namespace) -> int:
    """Run `shuttle engine --listen ENDPOINT`: one serving group (scheduler + worker, supervised and restarted
    here) whose scheduler listens on ENDPOINT for a frontend started elsewhere with `--engine-endpoint ENDPOINT`.
    Returns the exit status as serve() does."""
    if args.model_dir is None:
        print("shuttle: no MODEL_DIR given and the default ../shared/models/stories260K is missing", file=sys.stderr)
        return 2
    if args.distributed_executor_backend == "ray":
        print("shuttle: error: `shuttle engine` runs its serving group on this host; --distributed-executor-backend "
              "ray is `shuttle serve`'s (it places every group on the Ray cluster itself)", file=sys.stderr)
        return 2
    unused = _ray_flags_unused(args)
    if unused:
        print(f"shuttle: error: {unused}", file=sys.stderr)
        return 2
    tcp = args.listen.startswith("tcp://")
    if tcp and not os.environ.get(CURVE_ENV):
        print(f"shuttle: error: --listen on tcp:// needs CURVE keys in ${CURVE_ENV}, the same as the frontend's host "
              f"(make them once with `shuttle curve-keys`)", file=sys.stderr)
        return 2
    runtime_dir = tempfile.mkdtemp(prefix="shuttle-")
    try:
        tp = getattr(args, "tensor_parallel_size", 1)
        if args.zmq_transport == "tcp":
            control = f"ipc://{runtime_dir}/control.sock"
            requests, plans, results, *rank_plans = free_tcp_endpoints(3 + tp - 1)
            internal = IpcConfig(requests, plans, results, control, "", curve=True, rank_plans=tuple(rank_plans))
        else:
            internal = dataclasses.replace(IpcConfig.in_directory(runtime_dir, tensor_parallel_size=tp),
                                           supervisor="")
        ipc = dataclasses.replace(internal, requests=args.listen, curve=tcp or internal.curve)
        try:
            check_model_dir(args.model_dir, tokenizer=False)  # the frontend, on another host, tokenizes
            config = ShuttleConfig.from_args(args, ipc)
            config = resolve_config(config, 1, _cuda_devices(config))
            check_scheduler_files(config.scheduler)
            listen = tcp_listen(args.listen, "where frontends reach this engine, --listen")
            check_ports(([listen] if listen else []) + _rendezvous_listens(config, 1))
            plan_cores(allowed_cores(), tp, config.worker.worker_cores)  # refuses a bad --worker-cores
        except (ModelDirError, PortError, DeviceError, CoreError) as exc:
            print(f"shuttle: error: {exc}", file=sys.stderr)
            return 2
        _say_auto_dtype(args, config)
        return Launcher(config, None, [ipc], with_frontend=False).run()
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _cuda_devices(config: ShuttleConfig) -> int:
    """CUDA devices here, counted only when --device may use one (cpu needs no look)."""
    return 0 if config.worker.device == "cpu" else cuda_device_count()


def _frontend_listens(args: argparse.Namespace, config: ShuttleConfig) -> list[Listen]:
    """The frontend's TCP ports: HTTP (unless --port 0 or --uds) and the batch endpoint (PORT+1 unless
    --batch-endpoint)."""
    if config.api.uds and (problem := unix_socket_problem(config.api.uds)) is not None:
        raise PortError(f"--uds {config.api.uds}: {problem}")
    listens = [Listen(config.host, config.port, "the HTTP server, --port")] if config.port and not config.api.uds \
        else []
    flag = "--batch-endpoint" if args.batch_endpoint else "PORT+1 unless --batch-endpoint says otherwise ('none' " \
                                                          "turns it off)"
    batch = tcp_listen(config.batch_endpoint, f"the batch endpoint, {flag}")
    return listens + ([batch] if batch else [])


def _rendezvous_listens(config: ShuttleConfig, groups: int) -> list[Listen]:
    """A given --master-port (tensor parallel): rank 0 of group g listens on it + g (launcher/supervised_unit.py)."""
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1 or not parallel.master_port:
        return []
    return [Listen(parallel.master_addr, parallel.master_port + g,
                   "the tensor-parallel rendezvous, --master-port" + (f" + {g} for group {g}" if g else ""))
            for g in range(groups)]


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key-file, else --api-key, else $SHUTTLE_API_KEY, else $VLLM_API_KEY (a vLLM deployment's key keeps
    protecting it).

    Raises:
        OSError: the file cannot be read.
        ValueError: both flags are given, or the file's first line holds no key (an empty mounted secret would
            otherwise serve with no key at all).
    """
    if getattr(args, "api_key_file", None):
        if args.api_key:
            raise ValueError("--api-key and --api-key-file are both given: give one")
        with open(args.api_key_file) as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: its first line holds no key (an empty file "
                             f"would serve with no key at all)")
        return key
    return args.api_key or os.environ.get("SHUTTLE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


