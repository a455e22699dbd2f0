"""Preemption-tolerant training: save at a step boundary on SIGTERM, resume exactly.

The JAX counterpart of ``tf.distribute.experimental.PreemptionCheckpointHandler``.
Wrap each training step in :meth:`PreemptionCheckpointHandler.run`; when the
process is told to stop (SIGTERM by default) the handler lets the current step
finish, saves a checkpoint at the step boundary, and exits. A restarted job
builds the handler again, which restores that checkpoint and sets
``total_run_calls`` to the number of steps already done; a loop that picks its
data by ``total_run_calls``, or one that reads an input iterator given as
``data=`` (its position is saved with each step and restored with it), then
continues bit-for-bit as if never stopped. The checkpoint directory may be a
bucket URL (``gs://bucket/run``), where a Cloud TPU VM's state must live.

Single process: the signal sets a flag that :meth:`run` reads after the step.
Several processes (``jax.process_count() > 1``): JAX's coordination service
spreads the preemption notice (its own SIGTERM listener, started by
``jax.distributed.initialize``) and ``reached_preemption_sync_point`` makes
every process stop and save at the same step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import jax

from dtensor import Mesh
from dtensor.checkpoint import Checkpointer
from dtensor.checkpoint.datastate import check_iterator
from dtensor.compat import preemption_sync_manager
from dtensor.core.tree import is_node
from dtensor.runtime.exit_codes import EXIT_PREEMPTED

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig", "RESTARTABLE_EXIT_CODE"]

RESTARTABLE_EXIT_CODE = EXIT_PREEMPTED
"""The default exit status after a preemption save (143 = 128 + SIGTERM): "stopped, restart me".

Listed with every other status in :mod:`dtensor.runtime.exit_codes`.
"""

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class TerminationConfig:
    """What happens around a preemption (as in TensorFlow).

    Args:
        grace_period: seconds between the notice and the actual kill. With
            ``0`` (default) the handler saves at the first step boundary after
            the notice; with more it keeps training while another step and a
            save still fit in the remaining time (single process only).
        exit_fn: called after the preemption save instead of
            ``sys.exit(RESTARTABLE_EXIT_CODE)``.
        save_fn: called instead of the handler's own checkpoint save at
            preemption (interval saves still use the handler's).
        termination_watcher_fn: polled after every step; returning ``True``
            counts as a preemption notice (for platforms that announce
            preemption some other way than a signal).

    Examples:
        >>> from strategies.failure_handling import TerminationConfig
        >>> TerminationConfig(grace_period=30).grace_period
        30
    """

    grace_period: float = 0
    exit_fn: Callable[[], Any] | None = None
    save_fn: Callable[[], Any] | None = None
    termination_watcher_fn: Callable[[], bool] | None = None


def _preemption_service() -> bool:
    """Whether JAX's coordination service spreads preemption notices (multi-process runs)."""
    return preemption_sync_manager() is not None


class PreemptionCheckpointHandler:
    """Checkpoints a training loop at preemption and restores it at restart.

    Args:
        checkpoint_dir: the checkpoint directory (a :class:`dtensor.checkpoint.Checkpointer`'s):
            a local path or a URL such as ``gs://bucket/run``.
        checkpoint: a mapping from names to what is saved: Flax NNX modules
            and optimizers (restored in place), or any pytrees (restored by
            replacing the mapping's values, so the mapping must be mutable,
            e.g. a dict).
        strategy: the strategy the loop runs under; restored leaves that are
            not already laid out are placed on its mesh.
        save_interval_steps: also save every this many steps (``None``: only
            at preemption).
        termination_config: a :class:`TerminationConfig`.
        max_to_keep: how many checkpoints to keep.
        signals: the signals that announce a preemption (single process).
        async_save: write interval checkpoints in the background.
        data: the input iterator the loop reads (``get_state()``/``set_state()``:
            a Grain iterator, or ``iter()`` of a strategy's distributed
            dataset); its position is saved with every checkpoint and restored
            with it, so a resumed run reads exactly the batches it had not read.
        local_directory: a local tier on each host's fast storage (see
            :class:`dtensor.checkpoint.Checkpointer`): every save also writes
            there, each process keeping its own shards and a peer's; a restart
            resumes from the newest step of either tier (the local one, without
            reading the persistent directory or bucket, when it is as new).
        local_interval_steps: also save the local tier alone every this many
            steps (``None``: only with the persistent saves).

    Attributes:
        total_run_calls: the number of steps run, counting those before the
            restored checkpoint.
        restored_from_tier: where the restored step came from: ``"local"``
            (every process's own shards), ``"peer"`` (a replaced process's
            shards sent back by the peer that kept a copy), ``"persistent"``,
            or ``None`` (a fresh start).

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> from strategies.failure_handling import PreemptionCheckpointHandler
        >>> d = tempfile.mkdtemp()
        >>> state = {"w": jnp.zeros(3)}
        >>> h = PreemptionCheckpointHandler(d, state, save_interval_steps=2)
        >>> def step():
        ...     state["w"] = state["w"] + 1
        >>> for _ in range(5):
        ...     h.run(step)
        >>> h.close()
        >>> state2 = {"w": jnp.zeros(3)}
        >>> h2 = PreemptionCheckpointHandler(d, state2)
        >>> h2.total_run_calls, state2["w"].tolist()
        (4, [4.0, 4.0, 4.0])
        >>> h2.close()
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        checkpoint: Mapping[str, Any],
        strategy: Any = None,
        *,
        save_interval_steps: int | None = None,
        termination_config: TerminationConfig | None = None,
        max_to_keep: int | None = 3,
        signals: Sequence[int] = (signal.SIGTERM,),
        async_save: bool = True,
        data: Any = None,
        local_directory: str | os.PathLike[str] | None = None,
        local_interval_steps: int | None = None,
    ) -> None:
        if data is not None:
            check_iterator(data, "PreemptionCheckpointHandler")
        if not isinstance(checkpoint, Mapping):
            raise TypeError(
                f"checkpoint must be a mapping of names to NNX modules/optimizers or pytrees, got "
                f"{type(checkpoint).__name__}. Pass e.g. {{'model': model, 'optimizer': optimizer}}."
            )
        plain = [k for k, v in checkpoint.items() if not is_node(v)]
        if plain and not isinstance(checkpoint, MutableMapping):
            raise TypeError(
                f"checkpoint entries {plain[:3]} are plain pytrees, which are restored by replacing "
                f"the mapping's values, but the {type(checkpoint).__name__} given is read-only. Pass "
                "a dict (or hold NNX modules/optimizers, which are restored in place)."
            )
        for name, value in (
            ("save_interval_steps", save_interval_steps),
            ("local_interval_steps", local_interval_steps),
        ):
            if value is not None and value < 1:
                raise ValueError(
                    f"{name}={value!r} is not valid; use a positive int, or None to save only at "
                    "preemption."
                )
        if local_interval_steps is not None and local_directory is None:
            raise ValueError(
                f"local_interval_steps={local_interval_steps} needs local_directory= (each host's "
                "fast local storage) to save to."
            )
        self.checkpoint = checkpoint
        self.strategy = strategy
        self.save_interval_steps = save_interval_steps
        self.local_interval_steps = local_interval_steps
        self.restored_from_tier: str | None = None
        self.termination_config = termination_config or TerminationConfig()
        self.total_run_calls = 0
        self.data = data
        self._checkpointer = Checkpointer(
            checkpoint_dir,
            max_to_keep=max_to_keep,
            async_save=async_save,
            local_directory=local_directory,
        )
        self._last_saved: int | None = None
        self._notice_time: float | None = None
        self._step_seconds = 0.0
        self._save_seconds = 0.0
        self._multi_process = jax.process_count() > 1
        self._sync_point = self._multi_process and _preemption_service()
        if self._multi_process and not self._sync_point:
            _log.warning(
                "%d processes but JAX's preemption service is off; each process reacts to its own "
                "signals only. Send the signal to every process, or enable "
                "jax_enable_preemption_service before jax.distributed.initialize.",
                jax.process_count(),
            )
        self._previous_handlers: dict[int, Any] = {}
        self._closed = False
        if self._checkpointer.has_steps():
            latest = self._restore_latest()
            self.total_run_calls = self._last_saved = latest
            self.restored_from_tier = self._checkpointer.restored_tier
        if not self._sync_point and threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    # ---------------------------------------------------------------- state
    @property
    def checkpointer(self) -> Checkpointer:
        """The underlying :class:`dtensor.checkpoint.Checkpointer`."""
        return self._checkpointer

    def _mesh(self) -> Mesh | None:
        mesh = getattr(self.strategy, "mesh", None)
        return mesh if isinstance(mesh, Mesh) else None

    def _restore_latest(self) -> int:
        """Restore the newest intact step (damaged ones are skipped with a warning); its number.

        Damaged steps newer than it are deleted, so that training can write
        those step numbers again.
        """
        target = dict(self.checkpoint)
        mesh = self._mesh()
        if mesh is not None:
            with mesh:
                restored = self._checkpointer.restore(None, target, data=self.data)
        else:
            restored = self._checkpointer.restore(None, target, data=self.data)
        for name, value in target.items():
            if not is_node(value):
                self.checkpoint[name] = restored[name]  # type: ignore[index]
        step = int(self._checkpointer.restored_step or 0)  # set by every successful restore
        newer = [s for s in self._checkpointer.all_steps() if s > step]
        if newer:
            _log.warning(
                "checkpoint steps %s are damaged; resuming from step %d and deleting them so "
                "that those steps can be saved again",
                newer,
                step,
            )
            self._checkpointer.delete(newer)
        return step

    def save(self, step: int | None = None) -> None:
        """Save the checkpoint objects now, as ``step`` (default ``total_run_calls``)."""
        step = self.total_run_calls if step is None else step
        if step == self._last_saved:
            return
        start = time.monotonic()
        self._checkpointer.save(step, dict(self.checkpoint), force=True, data=self.data)
        self._save_seconds = time.monotonic() - start
        self._last_saved = step

    # ------------------------------------------------------------- signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        del frame
        if self._notice_time is None:
            self._notice_time = time.monotonic()
            _log.warning(
                "received signal %d; saving a checkpoint at the next step boundary", signum
            )

    @property
    def preemption_noticed(self) -> bool:
        """Whether this process has received a preemption notice (signal or watcher)."""
        return self._notice_time is not None

    def _should_stop(self, step: int) -> bool:
        watcher = self.termination_config.termination_watcher_fn
        if watcher is not None and self._notice_time is None and watcher():
            self._notice_time = time.monotonic()
        if self._sync_point:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        if self._notice_time is None:
            return False
        grace = self.termination_config.grace_period
        if grace and not self._multi_process:
            left = grace - (time.monotonic() - self._notice_time)
            return left <= 2 * (self._step_seconds + self._save_seconds)
        return True

    # ----------------------------------------------------------------- run
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one training step ``fn(*args, **kwargs)`` and return its result.

        Counts the step in ``total_run_calls``; saves every
        ``save_interval_steps``; after a preemption notice, saves at this step
        boundary and exits (``exit_fn`` or ``sys.exit(RESTARTABLE_EXIT_CODE)``).
        """
        if self._closed:
            raise RuntimeError("this PreemptionCheckpointHandler is closed; create a new one.")
        start = time.monotonic()
        result = fn(*args, **kwargs)
        self._step_seconds = time.monotonic() - start
        self.total_run_calls += 1
        step = self.total_run_calls
        if self._should_stop(step):
            self._preempt(step)
        elif self.save_interval_steps and step % self.save_interval_steps == 0:
            self.save(step)
        elif self.local_interval_steps and step % self.local_interval_steps == 0:
            self._checkpointer.save_local(step, dict(self.checkpoint), data=self.data)
        return result

    def _preempt(self, step: int) -> None:
        save_fn = self.termination_config.save_fn
        try:
            if save_fn is not None:
                save_fn()
            else:
                self.save(step)
            self.close()
        except Exception as e:  # noqa: BLE001 - said at once; the restart resumes from what stands
            self._closed = True
            _log.error(
                "the preemption checkpoint of step %d FAILED (%s: %s); a restart resumes from %s",
                step,
                type(e).__name__,
                str(e)[:400],
                self._what_stands(step),
            )
        else:
            _log.warning("preemption checkpoint at step %d written; exiting", step)
        exit_fn = self.termination_config.exit_fn
        if exit_fn is not None:
            exit_fn()
        else:
            sys.exit(RESTARTABLE_EXIT_CODE)

    def _what_stands(self, step: int) -> str:
        """The newest step a restart can take after a failed save of ``step`` (this process's view)."""
        local = self._checkpointer.local
        if local is not None:
            try:
                local.wait()
            except OSError:
                pass
            if step in local.steps():
                return f"the local tier's step {step} (in {local.folder})"
        try:
            steps = [s for s in self._checkpointer.all_steps() if s < step]
        except Exception:  # noqa: BLE001 - the store that just failed may fail again
            steps = []
        return f"persistent step {steps[-1]}" if steps else "step 0 (no earlier complete step)"

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for pending saves, release the checkpointer and restore signal handlers."""
        if self._closed:
            return
        self._closed = True
        self._checkpointer.close()
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous)
        self._previous_handlers.clear()

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
