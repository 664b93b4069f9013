"""Orbax checkpoints of the whole train state plus the data loader's position.

Layout: `<workdir>/checkpoints/<step>/{state,data}`. Restore targets carry shardings, so a
checkpoint written on one mesh restores onto another. A latest checkpoint that is truncated or
corrupt is reported and skipped in favour of the previous good one, and replaced once the
resumed run saves that step again; a checkpoint whose shapes do not match the model names the
mismatching parameters.
"""

import logging
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def reached_preemption(step: int) -> bool:
    """JAX's multi-host preemption sync point (every process agrees on the step); False without the service."""
    from jax.experimental import multihost_utils

    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:
        return False


class IncompatibleCheckpointError(ValueError):
    pass


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class Checkpointer:
    """Saves and restores (state, data_state) under `directory`; keeps the newest `max_to_keep`."""

    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
        )

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        # Steps >= `step` can only be unreadable checkpoints a resumed run fell back past; orbax would
        # skip (or, forced, refuse) every save up to the newest of them, so they are dropped first.
        for stale in [s for s in self.steps() if s >= step]:
            self.manager.delete(stale)
        return self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
            force=force,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def check_compatible(self, step: int, target: Any) -> None:
        """Raises IncompatibleCheckpointError naming every leaf whose saved shape differs from `target`."""
        saved = self.manager.item_metadata(step)["state"]
        saved_shapes = {_path_str(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved)[0] if hasattr(m, "shape")}
        target_shapes = {_path_str(p): tuple(t.shape) for p, t in jax.tree_util.tree_flatten_with_path(target)[0]}
        problems = [f"{k}: checkpoint {saved_shapes[k]} vs model {v}" for k, v in target_shapes.items() if k in saved_shapes and saved_shapes[k] != v]
        problems += [f"{k}: missing from the checkpoint" for k in target_shapes if k not in saved_shapes]
        problems += [f"{k}: in the checkpoint but not in the model" for k in saved_shapes if k not in target_shapes]
        if problems:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.directory / str(step)} does not match the configured model "
                f"({len(problems)} mismatching parameters):\n  " + "\n  ".join(problems[:20])
                + "\nUse the config the checkpoint was written with, or a new workdir."
            )

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """target: a pytree of jax.ShapeDtypeStruct with shardings."""
        self.check_compatible(step, target)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        )
        return restored["state"], dict(restored["data"])

    def restore_latest(self, target: Any) -> tuple[int, Any, dict] | None:
        """The newest checkpoint that restores, falling back past corrupt ones; None if there is none."""
        for step in reversed(self.steps()):
            try:
                state, data_state = self.restore(step, target)
            except IncompatibleCheckpointError:
                raise
            except Exception as e:  # orbax raises ValueError/OSError/KeyError variants for damaged files
                log.warning("checkpoint %s is unreadable (%s: %s); trying the previous one", self.directory / str(step), type(e).__name__, str(e)[:300])
                continue
            return step, state, data_state
        return None
