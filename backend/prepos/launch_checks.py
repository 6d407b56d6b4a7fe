"""What the launcher checks before it starts tritonserver, so that a bad folder, TLS pair, address or model
repository is refused at once naming its flag, rather than seconds later by Triton or the model's load with a
message that names neither (a TLS key that does not match its certificate showed as a port "already in use")."""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import json
import logging
import os
import signal
import socket
import ssl
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Sequence

log = logging.getLogger("prepos.launcher")

_PR_SET_PDEATHSIG = 1


def usable_dir(path: str | Path, flag: str) -> Path:
    """``path``, made if missing, when this process can write in it. Raises ValueError naming ``flag``: a file in
    the way, no permission, a read-only or missing parent."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag}: cannot use {path} ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot write in {path}")
    return path


def unusable_folder(path: Path) -> str | None:
    """Why the folder ``path`` cannot be used (made where missing, written in), or None. Nothing is left changed:
    a folder made and removed at once in its nearest existing ancestor tells (a permission, a read-only or a
    pseudo file system), before anything is loaded or written."""
    base = path
    while not os.path.lexists(base) and base != base.parent:
        base = base.parent
    if not os.path.isdir(base):
        return f"{path} exists and is not a folder" if base == path else \
            f"cannot make {path}: {base} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".prepos-probe-", dir=base))
    except OSError as error:
        reason = error.strerror or error
        return f"cannot write in {path} ({reason})" if base == path else f"cannot make {path} in {base} ({reason})"
    return None


def check_tls_pair(cert_file: str, key_file: str) -> None:
    """Raise ValueError naming both flags unless ``cert_file`` holds a PEM certificate chain and ``key_file`` its
    unencrypted private key (Triton reads no encrypted key)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # the pair's form, not this OpenSSL's policy on key sizes or digests
    try:
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"--tls-cert-file {cert_file} and --tls-key-file {key_file}: not a PEM certificate chain "
                         f"and its unencrypted private key ({getattr(err, 'reason', None) or err})") from None


def check_host(host: str) -> None:
    """Raise ValueError for an IPv6 address: Triton 2.51 puts it unbracketed before the gRPC port (``::1:8001``),
    which its gRPC server cannot bind, and reports the port as in use."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return  # a name: see bind_address
    if address.version == 6:
        raise ValueError(f"--host: {host} is an IPv6 address, which Triton 2.51's gRPC endpoint cannot bind here; use "
                         "an IPv4 address (127.0.0.1, or 0.0.0.0 for every interface)")


def bind_address(host: str) -> str:
    """The IPv4 address tritonserver binds for ``host``: itself if it is one, else the first IPv4 address of the
    name (given ``localhost``, Triton's HTTP endpoint bound 255.255.255.255 and the launcher waited its whole
    ready timeout). Raises ValueError naming ``--host`` for a name with no IPv4 address."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError as err:
        raise ValueError(f"--host: {host!r} has no IPv4 address ({err.strerror or err}); give an IPv4 address") \
            from None


def _readable_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a folder this process may not look into (lost+found on a volume, say): no model there
        return False


def journal_environment(journal_dir: str, run_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``PREPOS_JOURNAL_DIR`` for the server: ``--journal-dir`` where given (``off``: none, whatever the
    environment says), else the environment's, else ``<run-dir>/journal``; its folder made and checked. Raises
    ValueError naming the flag or the variable that gave an unusable folder."""
    if journal_dir == "off":
        return {"PREPOS_JOURNAL_DIR": ""}  # the environment's, if any, would win otherwise
    if journal_dir:
        chosen, source = journal_dir, "--journal-dir"
        if environ.get("PREPOS_JOURNAL_DIR") not in (None, "", journal_dir):
            log.info("--journal-dir %s wins over PREPOS_JOURNAL_DIR=%s", journal_dir, environ["PREPOS_JOURNAL_DIR"])
    elif "PREPOS_JOURNAL_DIR" in environ:
        if not environ["PREPOS_JOURNAL_DIR"]:
            return {}  # set empty: no journals, as documented
        if not Path(environ["PREPOS_JOURNAL_DIR"]).is_absolute():
            return {}  # relative to the model's folder, as journal.dir is: the model makes it
        chosen, source = environ["PREPOS_JOURNAL_DIR"], "PREPOS_JOURNAL_DIR"
    else:
        chosen, source = str(run_dir / "journal"), "--run-dir"
    return {"PREPOS_JOURNAL_DIR": str(usable_dir(chosen, source).resolve())}


@functools.cache
def _listed_config_type():
    """Triton's ModelConfig message with its maps read as lists of entries, so that a key set twice shows (a map
    keeps one of the two). Built once."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from tritonclient.grpc import model_config_pb2

    file = descriptor_pb2.FileDescriptorProto()
    model_config_pb2.DESCRIPTOR.CopyToProto(file)
    for message in file.message_type:
        for nested in message.nested_type:
            nested.options.map_entry = False
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{file.package}.ModelConfig"))


def _as_triton_hands_it_over(model, idle_us: int) -> dict:
    """The parts of a parsed config.pbtxt that :func:`prepos.config.check_model_config` reads, as the model's
    ``args["model_config"]`` has them: the instance groups as written (a group naming no GPUs is one instance
    here, where Triton would make one per GPU it finds: the model's own check still sees those), and the
    sequence idle timeout with Triton's default filled in."""
    groups = [{"count": group.count or 1, "gpus": list(group.gpus)} for group in model.instance_group]
    return {"instance_group": groups, "sequence_batching": {"max_sequence_idle_microseconds": idle_us} if idle_us
            else {}}


def check_repositories(repositories: Sequence[str | Path], environ: Mapping[str, str]) -> None:
    """Raise ValueError naming ``--model-repository`` when the repositories hold no model (folders with a
    config.pbtxt): Triton would start with nothing to serve and report ready. And read the prepos settings of
    each prepos model (config.pbtxt's parameters, the ``PREPOS_*`` variables of ``environ``) as the model will
    when it loads, with what of its Triton configuration prepos cannot run with (more than one instance, Triton's
    1 s sequence idle default), so that a bad one is refused before Triton starts (the load took 7-11 s to say the
    same), raising ValueError naming the model and the setting, or the place in its config.pbtxt that is not protobuf
    text format (Triton's parser refuses it too). A parameter set twice is taken as Triton 2.51 takes it, the later
    entry, with a warning. Other models' configs are Triton's to read."""
    from google.protobuf import text_format

    from prepos.config import TRITON_DEFAULT_IDLE_US, ConfigError, check_model_config, read_config

    configs = sorted((entry / "config.pbtxt" for repository in repositories for entry in Path(repository).iterdir()
                      if _readable_file(entry / "config.pbtxt")), key=lambda config: config.parent.name)
    if not configs:
        raise ValueError(f"--model-repository: no model in {', '.join(str(r) for r in repositories)} (a model is a "
                         "folder with a config.pbtxt)")
    for config in configs:
        name = config.parent.name
        if not name.startswith("prepos") or name == "prepos_http":
            continue
        try:  # the ModelConfig message Triton parses config.pbtxt into (fields of a later Triton passed over)
            model = text_format.Parse(config.read_text(errors="replace"), _listed_config_type()(),
                                      allow_unknown_field=True)
        except text_format.ParseError as err:
            raise ValueError(f"model {name} ({config}): not a model configuration Triton reads ({err})") from None
        keys = [entry.key for entry in model.parameters]
        twice = sorted({key for key in keys if keys.count(key) > 1})
        if twice:
            log.warning("model %s (%s) sets %s twice: the later entry counts", name, config,
                        ", ".join(map(json.dumps, twice)))
        parameters = {entry.key: entry.value.string_value for entry in model.parameters}  # the later wins
        idle_us = model.sequence_batching.max_sequence_idle_microseconds
        if not idle_us and model.HasField("sequence_batching"):
            idle_us = TRITON_DEFAULT_IDLE_US  # what Triton fills in where config.pbtxt leaves it out
        try:
            check_model_config(_as_triton_hands_it_over(model, idle_us), parameters, environ)
            if idle_us:  # as the model sets it from Triton's own (see its model.py)
                parameters.setdefault("scheduler.session_idle_timeout_s", str(idle_us / 1e6))
            read_config(parameters, environ)
        except ConfigError as err:
            raise ValueError(f"model {name} ({config}): {err}") from None


def stop_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child killed (SIGKILL) when this process dies (Linux's parent-death signal):
    a launcher killed with SIGKILL, or by the OOM killer, left tritonserver serving on its ports with no one to
    stop it. Not SIGTERM: with no launcher to drain it, tritonserver went on serving the requests in flight to its
    exit timeout, then crashed on its way out and hung there, its streams still open, so that clients waited out
    their time limits; killed, its streams break at once and its backend stubs exit by themselves. None elsewhere,
    and off the main thread (the signal follows the thread that started the child)."""
    import threading

    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child between fork and exec loads nothing

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was set
            os._exit(1)

    return preexec
