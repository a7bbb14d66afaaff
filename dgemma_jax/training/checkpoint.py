"""Training checkpoints with orbax: params, optimizer state, step, rng and the data iterator position.

One checkpoint = a step directory with two items::

    <dir>/<step>/state   StandardSave of {"step", "params", "opt_state", "rng"}
    <dir>/<step>/data    JsonSave of the iterator state ({"index": next batch}) plus metadata

`directory` is a local path or a gs:// URL, handed to orbax as it is (`locations.orbax_path`). On a
local disk orbax writes each step into a temporary directory and renames it when complete; on gs://
(no atomic rename) it writes the step in place and marks it complete with a commit_success.txt last.
Either way a process killed mid-save (even by SIGKILL) leaves only whole checkpoints behind:
`latest_step()` ignores the rest, and the next Checkpointer on the directory removes them.

Multi-host: every process constructs the Checkpointer and calls save/restore with the same global
arrays (orbax's multi-host protocol: each process writes the shards it holds, in files of its own
(ocdbt.process_<i>/), process 0 the metadata and the JSON item, with barriers between the phases).
Restoring needs an abstract target (`jax.eval_shape` of a fresh state, optionally with shardings),
which fixes the pytree structure of the optimizer state and where the arrays go.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from dgemma_jax.io.locations import orbax_path
from dgemma_jax.training.step import TrainState


def _state_dict(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng}


class Checkpointer:
    """Thin wrapper around `ocp.CheckpointManager` (synchronous saves by default)."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = False):
        self.directory = orbax_path(directory, "train.workdir's checkpoint directory")
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
                                            enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: TrainState, data_state: dict[str, Any], *, force: bool = False) -> bool:
        saved = self.manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(_state_dict(state)),
            data=ocp.args.JsonSave(dict(data_state))), force=force)
        return bool(saved)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore(self, abstract_state: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """(state, data_state) of `step` (default: the latest). abstract_state: shapes/dtypes
        (and shardings) of the state, e.g. `jax.eval_shape(lambda: state)`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, _state_dict(abstract_state))
        out = self.manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        d = out["state"]
        state = TrainState(step=d["step"], params=d["params"], opt_state=d["opt_state"], rng=d["rng"])
        return state, dict(out["data"])

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# Inference checkpoints (params alone) are the model-directory format's; re-exported here.
from dgemma_jax.io.model_dir import load_params, save_params  # noqa: E402,F401
