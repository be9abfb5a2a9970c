"""``capture --engine vllm``: the target's forward runs in vLLM, everything else stays in tapdraft.

tapdraft tokenizes (its own chat template and assistant mask), plans windows and batches, computes
the teacher top-k rows from the last layer with the bundle's head, and writes shards exactly as with
the in-process engine; vLLM only turns prompt token ids into the tapped layers' hidden states. So the
dataset contract (schema, fingerprint, bundle, resume, skips, lock) is the pipeline's, unchanged.

vLLM runs in its own Python environment (it pins torch and transformers; docs/capture-engines.md):
:class:`VLLMEngine` starts ``data_parallel_size`` worker processes with that environment's Python
(``capture.vllm.side.worker``, imported under a private top-level name from a temporary directory, so
nothing else of tapdraft enters vLLM's interpreter), listens on a Unix socket in that directory, and
receives each request's states from :class:`capture.vllm.side.connector.TapConnector` as one frame:
no per-request files, no /dev/shm staging, no pinned memory. Each worker gets
``tensor_parallel_size x pipeline_parallel_size`` devices (on CPU: ranks of vLLM's multiprocessing
executor, the thread budget split among them); a window's requests are dealt to the workers in turn.
Pipeline parallelism is refused up front where vLLM is known to refuse it (:func:`check_layout`).

Speech targets (Qwen2-Audio): a request is the template's ids with ONE audio token an audio, plus the
waveforms tapdraft decoded and resampled (``multi_modal_data``, float32 at the encoder's rate, sent as the
run frame's payload); vLLM's own processor computes the features and expands each audio token to its
frames, and the connector returns the expanded prompt ids, which must equal tapdraft's expansion
(capture.targets.hf_speech) token for token or the capture stops with a CaptureError: ``is_audio`` and the loss
mask are tapdraft's, on ids both engines agree on. Which targets run here, and why the others do not:
each adapter's ``vllm_refused`` and docs/capture-engines.md.

Layer numbering: vLLM's id i is the INPUT of decoder layer i, so tapdraft's tap t (output of layer t)
is vLLM id t + 1 (``shards.taps.to_vllm``) and the last layer's pre-norm output is id L, always
requested: the teacher rows are computed from it here, as the in-process engine computes them.

Determinism: a window is submitted whole, in plan order, whenever any of its samples is unfinished,
so a resumed window runs the same requests in the same schedule as the first attempt; and the CPU thread
count, which orders fp32 reductions (tapdraft's teacher head, vLLM's ranks: captures of the BPE target
at 1 and 2 threads differ in 15 of 64 samples' top-k log-probs, up to 2.9e-6), is a recorded setting
(``VLLMConfig.threads``) that a resume takes from the record rather than from its process. So a capture
is a function of its inputs and settings, and the resumed dataset equals an uninterrupted one bit for bit
(tests/engines/test_vllm_capture.py kills a capture with SIGKILL).
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from tapdraft.capture.forward import SampleSpec, sample_fields
from tapdraft.capture.head import UnsupportedHead
from tapdraft.capture.targets.base import Prepared, Target
from tapdraft.capture.vllm.config import VLLMConfig
from tapdraft.capture.vllm.side import wire
from tapdraft.common.errors import CaptureError
from tapdraft.shards.schema import Layout
from tapdraft.shards.taps import to_vllm

SIDE_NAME = "tapdraft_vllm_side"
"""The top-level name ``capture/vllm/side`` is imported under inside vLLM's interpreter."""
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_PROBE = ("import importlib.util as u, importlib.metadata as m, sys\n"
          "if u.find_spec('vllm') is None: sys.exit(1)\n"
          "print(m.version(m.packages_distributions().get('vllm', ['vllm'])[0]))")
"""Finds vllm and prints its release without importing it (that takes seconds)."""
PP_REFUSED_THROUGH = (0, 32)
"""vLLM releases up to this one refuse ``extract_hidden_states`` with pipeline parallelism (docs/capture-engines.md)."""


def check_python(python: str | None, layout: VLLMConfig | None = None) -> str:
    """The vLLM environment's interpreter, checked to hold vllm, and its vLLM to run ``layout``; CaptureError
    saying what to give otherwise."""
    exe = python or sys.executable
    if python is not None and not Path(python).is_file():
        raise CaptureError(f"--vllm-python {python} does not exist; give the python of an environment with vllm "
                           "installed (`tapdraft venv vllm` builds one and prints its path)")
    res = subprocess.run([exe, "-c", _PROBE], capture_output=True, text=True, env=_engine_env({}, None), timeout=120)
    if res.returncode != 0:
        raise CaptureError(f"{exe} has no vllm installed; give --vllm-python the python of an environment with vllm "
                           "installed (`tapdraft venv vllm` builds one and prints its path)")
    if layout is not None:
        check_layout(layout, res.stdout.strip())
    return exe


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as '0.32.0' or '0.33.1.dev4+gabc'; () when it has none."""
    parts = version.split(".")[:2]
    return tuple(int(p) for p in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else ()


def check_layout(cfg: VLLMConfig, version: str) -> None:
    """Refuse a parallel layout that this vLLM release is known not to run, before anything is loaded.

    Pipeline parallelism: vLLM 0.32 builds ``extract_hidden_states``' draft model config from the target's
    and checks it against the target's parallel config; its architecture (``ExtractHiddenStatesModel``)
    does not implement ``SupportsPP``, so any PP > 1 fails in ``ModelConfig.verify_with_parallel_config``
    (vllm/config/speculative.py, vllm/config/model.py), on CPU and GPU alike; and the V1 model runner
    puts the drafter, hence the cache-only layer, on the last stage only (vllm/v1/worker/gpu_model_runner.py).
    """
    rel = _release(version)
    if cfg.pipeline_parallel_size > 1 and rel and rel <= PP_REFUSED_THROUGH:
        raise CaptureError(f"--pipeline-parallel-size {cfg.pipeline_parallel_size}: vLLM {version} cannot extract "
                           "hidden states with pipeline parallelism (its extract_hidden_states model does not support "
                           "PP); split the target with --tensor-parallel-size instead")


def _engine_env(extra: dict[str, str], path: str | None) -> dict[str, str]:
    """The worker's environment: tapdraft's own interpreter settings removed, vLLM's offline settings added."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", **extra)
    if path is not None:
        env["PYTHONPATH"] = path
    return env


@dataclass
class Request:
    """One prompt for vLLM: what it is sent, and the ids its states must come back for."""

    tag: int
    sample_id: str
    prompt_ids: list[int]  # one audio token an audio: vLLM's processor expands it
    expected_ids: list[int]  # tapdraft's expanded ids (== prompt_ids for a text sample)
    audio: list[np.ndarray]  # float32 waveforms at ``sample_rate``
    sample_rate: int | None = None


def request(target: Target, p: Prepared) -> Request:
    """The vLLM request of a prepared sample (speech: the unexpanded ids and the decoded waveforms)."""
    ids = p.token_ids.tolist()
    prompt = getattr(p, "prompt_ids", None)
    if not p.waveforms or prompt is None:
        return Request(p.index, p.sample_id, ids, ids, [])
    waves = [np.ascontiguousarray(w, dtype=np.float32) for w in p.waveforms]
    return Request(p.index, p.sample_id, prompt.tolist(), ids, waves, target.sample_rate)


def _checked_states(header: dict[str, Any], payload: bytearray, req: Request) -> torch.Tensor:
    """A states frame as a tensor [T, n_layers, H], checked to cover exactly the request's expected ids."""
    if header["token_ids"] != req.expected_ids:
        n, m = len(header["token_ids"]), len(req.expected_ids)
        if req.audio:
            raise CaptureError(
                f"vLLM expanded the audio of sample {req.sample_id!r} into {n} prompt tokens, not the {m} "
                "tapdraft's processor gives: its dataset would record other audio positions than the "
                "in-process engine's, so the capture stops before writing it (the two environments' audio "
                "processors disagree: compare their transformers versions); capture this target in-process "
                "(drop --engine vllm)")
        raise CaptureError(f"vLLM's states for sample {req.tag} cover {n} tokens that are "
                           f"not the {m} prompt tokens sent (prefix caching or truncation?)")
    dtype = _TORCH_DTYPES[header["dtype"]]
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(header["shape"])


class VLLMEngine:
    """vLLM worker processes that return each prompt's tapped states [T, n_layers, H] (module docstring)."""

    def __init__(self, cfg: VLLMConfig, *, python: str | None, target_dir: str, layer_ids: Sequence[int],
                 dtype: str, max_model_len: int, threads: int | None = None, timeout: float = 900.0,
                 mode: str = "capture", prefix_caching: bool = False):
        assert mode in ("capture", "generate"), mode
        assert mode == "generate" or not prefix_caching, "a capture's states are each prompt's own forward"
        self.cfg, self.layer_ids, self.timeout, self.mode = cfg, list(layer_ids), timeout, mode
        self.python = check_python(python, cfg)
        self.dir = Path(tempfile.mkdtemp(prefix="tapdraft-vllm-"))
        (self.dir / SIDE_NAME).symlink_to(Path(__file__).with_name("side").resolve(), target_is_directory=True)
        self.address = str(self.dir / "socket")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen(64)
        self.events: queue.Queue = queue.Queue()
        self.drivers: dict[int, socket.socket] = {}
        self.procs: list[subprocess.Popen] = []
        self.version = ""
        self._window = 0
        t0 = time.perf_counter()
        threading.Thread(target=self._accept, name="vllm-accept", daemon=True).start()
        llm = {"model": str(target_dir), "dtype": dtype, "enforce_eager": True, "seed": 0,
               "max_model_len": int(max_model_len), "tensor_parallel_size": cfg.tensor_parallel_size,
               "pipeline_parallel_size": cfg.pipeline_parallel_size, "disable_log_stats": True}
        if cfg.max_num_batched_tokens is not None:
            llm["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        if mode == "generate":
            llm["enable_prefix_caching"] = prefix_caching
        per = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
        extra = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kv_cache_gib)}
        if threads:  # the budget is shared by every rank of every engine
            extra.update(OMP_NUM_THREADS=str(max(1, threads // (per * cfg.data_parallel_size))),
                         VLLM_CPU_OMP_THREADS_BIND="nobind")
        try:
            for r in range(cfg.data_parallel_size):
                env = _engine_env(extra, str(self.dir))
                if cfg.data_parallel_size > 1 and torch.cuda.is_available():
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(r * per, (r + 1) * per))
                log = open(self.dir / f"worker-{r}.log", "wb")
                self.procs.append(subprocess.Popen(
                    [self.python, "-m", f"{SIDE_NAME}.worker", self.address, str(r)], stdout=log,
                    stderr=subprocess.STDOUT, env=env, cwd=self.dir, start_new_session=True))
                log.close()
            self._start(llm)
            self.startup_s = time.perf_counter() - t0  # launch to all ready: interpreter, vLLM import, load, warm-up
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), name="vllm-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while True:
                header, payload = wire.recv(conn)
                self.events.put((conn, header, payload))
        except (wire.Closed, OSError):
            return

    def _log_tail(self, lines: int = 25) -> str:
        out = []
        for p in sorted(self.dir.glob("worker-*.log")):
            text = p.read_text(errors="replace").splitlines()
            out.append(f"--- {p} (last {lines} lines)\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def _next(self) -> tuple[socket.socket, dict[str, Any], bytearray]:
        """The next frame from any worker; CaptureError when one died or reported an error."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn, header, payload = self.events.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self.procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    what = f"exited with code {dead[0].returncode}" if dead else f"sent nothing for {self.timeout:.0f}s"
                    self.keep_logs = True
                    raise CaptureError(f"the vLLM worker {what}; its log is in {self.dir}. The finished shards are "
                                       f"kept: fix the cause and rerun the same command to resume.\n{self._log_tail()}"
                                       ) from None
                continue
            if header.get("kind") == "error":
                self.keep_logs = True
                raise CaptureError(f"vLLM failed: {header['message']} (log in {self.dir}). The finished shards are "
                                   "kept: fix the cause and rerun the same command to resume.")
            return conn, header, payload

    def _start(self, llm: dict[str, Any]) -> None:
        while len(self.drivers) < len(self.procs):
            conn, header, _ = self._next()
            if header.get("kind") == "hello":
                self.drivers[int(header["worker"])] = conn
                start = {"kind": "start", "llm": llm, "layer_ids": self.layer_ids}
                if self.mode != "capture":  # capture.vllm.regenerate: plain generation, no states
                    start["mode"] = self.mode
                wire.send(conn, start)
        ready = 0
        while ready < len(self.procs):
            _, header, _ = self._next()
            if header.get("kind") == "ready":
                ready += 1
                self.version = header["vllm"]

    # ------------------------------------------------------------------ use
    def states(self, requests: Sequence[Request]) -> Iterator[tuple[int, torch.Tensor]]:
        """(tag, states [T, n_layers, H]) for each request, in arrival order; each is checked to cover exactly
        the expected (expanded) ids."""
        want = {r.tag: r for r in requests}
        self._send(requests)
        got = 0
        while got < len(want):
            _, header, payload = self._next()
            if header.get("kind") != "states":
                continue
            tag = header["tag"]
            if tag not in want:
                raise AssertionError(f"vLLM returned states for request {tag!r}, which this window did not send")
            hs = _checked_states(header, payload, want[tag])
            got += 1
            yield tag, hs

    def _send(self, requests: Sequence[Request], logprobs: int | None = None) -> None:
        """One window's run frames: its requests dealt to the workers in turn."""
        self._window += 1
        for w, conn in sorted(self.drivers.items()):
            mine = [r for k, r in enumerate(requests) if k % len(self.drivers) == w]
            if mine:
                head = [{"tag": r.tag, "prompt_token_ids": r.prompt_ids, "audio": [int(a.shape[0]) for a in r.audio],
                         "sample_rate": r.sample_rate} for r in mine]
                audio = [a for r in mine for a in r.audio]
                payload = np.concatenate(audio) if audio else b""
                frame = {"kind": "run", "window": self._window, "requests": head}
                if logprobs:
                    frame["logprobs"] = logprobs
                wire.send(conn, frame, payload)

    def probe(self, request: Request, k: int) -> tuple[torch.Tensor, list[tuple[int, float]]]:
        """One request's states [T, n_layers, H] and vLLM's own top-``k`` next-token log-probs after its prompt."""
        self._send([request], logprobs=k)
        window, states, top = self._window, None, None
        while states is None or top is None:  # the done frame and the states come on two connections, either first
            _, header, payload = self._next()
            if header.get("kind") == "states" and header.get("tag") == request.tag:
                states = _checked_states(header, payload, request)
            elif header.get("kind") == "done" and header.get("window") == window:
                top = [(int(i), float(lp)) for i, lp in header["logprobs"][str(request.tag)]]
        return states, top

    keep_logs = False

    def close(self) -> None:
        for conn in self.drivers.values():
            try:
                wire.send(conn, {"kind": "stop"})
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.listener.close()
        for conn in self.drivers.values():
            conn.close()
        if not self.keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def check_target(target: Target, *, audio_embeds: bool = False) -> None:
    """CaptureError unless ``--engine vllm`` captures this target as the in-process engine would (the adapter's
    ``vllm_refused`` says why not)."""
    why = target.vllm_refused
    if why is not None:
        raise CaptureError(f"--engine vllm does not capture {target.kind or type(target).__name__} targets: {why}; "
                           "capture it with the in-process engine (drop --engine vllm)")
    if audio_embeds and target.placeholder is not None:
        raise CaptureError("--audio-embeds stores the in-process encoder's frames, which vLLM computes inside its "
                           "forward and does not return; drop --audio-embeds or --engine vllm")


PROBE_TOKENS, PROBE_TOP = 8, 5
"""The head proof's prompt length and how many of vLLM's next-token log-probs it compares."""


def prove_head(engine: VLLMEngine, target: Target, layout: Layout) -> float:
    """Prove the head tapdraft derived (``target.head``) against vLLM's own, or raise UnsupportedHead.

    The in-process engine proves it on the model's forward (``capture.head.check_head``); here the forward
    is vLLM's, and with a head-only target (``capture.targets.head_only``) no decoder is in this process at all. So
    one probe prompt goes to vLLM with its top next-token log-probs asked for: tapdraft's head applied to
    the last layer's state vLLM returns at the prompt's last position must give the same log-probs for
    those ids (tolerance as ``check_head``'s). Returns the largest difference.
    """
    V = int(target.head.embed_tokens.shape[0])
    ids = [int(i) for i in torch.arange(PROBE_TOKENS) * 7919 % V]  # spread over the vocabulary, deterministic
    states, top = engine.probe(Request(-1, "head probe", ids, ids, []), PROBE_TOP)
    last = layer_ids(layout.tap_ids, layout.num_layers).index(layout.num_layers)
    logits = target.head.logits(states[-1:, last].to(target.device)).double()[0]
    ours = torch.log_softmax(logits, dim=-1)
    tol = 1e-4 if target.head.lm_head.dtype == torch.float32 else 3e-2
    err = max(abs(float(ours[i]) - lp) for i, lp in top)
    if err > tol * (1 + float(logits.abs().max())):
        raise UnsupportedHead(
            f"vLLM's next-token log-probs differ from the head tapdraft derived ({target.head.spec}) by up to "
            f"{err:.3g}: vLLM computes this target's logits otherwise, so its teacher rows would not be the "
            "target's; capture it in-process (drop --engine vllm)")
    return err


def layer_ids(tap_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM layer ids to extract: the taps (``shards.taps.to_vllm``) and the last layer's output (id L)."""
    return sorted(set(to_vllm(list(tap_ids))) | {num_layers})


def vllm_batches(engine: VLLMEngine, target: Target, window: Sequence[Sequence[Prepared]], todo: Sequence[bool],
                 spec: SampleSpec) -> Iterator[tuple[list[Prepared], list[dict[str, torch.Tensor]]]]:
    """(batch, stored fields) for the batches of ``window`` whose ``todo`` is set, in window order.

    The whole window goes to vLLM (same requests, same schedule on a resume); each batch is yielded as
    soon as its samples' states are in, with the fields :func:`capture.forward.sample_fields` builds for
    the in-process engine from (taps, last layer).
    """
    L = target.num_layers
    ids = layer_ids(spec.tap_ids, L)
    cols = [ids.index(t + 1) for t in spec.tap_ids]
    last = ids.index(L)
    flat = [p for b in window for p in b]
    got: dict[int, torch.Tensor] = {}
    stream = engine.states([request(target, p) for p in flat])
    dev = target.device
    for batch, need in zip(window, todo):
        for p in batch:
            while p.index not in got:
                tag, hs = next(stream)
                got[tag] = hs
        if not need:
            continue
        states = [(got[p.index][:, cols].to(dev), got[p.index][:, last].to(dev)) for p in batch]
        exps = target.expand_tokens(batch)  # the audio's embeddings are vLLM's: no encoder runs here
        yield list(batch), sample_fields(target, exps, states, spec)
        for p in batch:
            del got[p.index]
