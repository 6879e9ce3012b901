"""A wrapper's ``state_dict`` is the wrapped model's, key for key (:class:`ModelKeys`)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["ModelKeys"]


class ModelKeys:
    """Mixin of the wrappers: the wrapper's ``state_dict`` is the wrapped model's, key for key.

    A wrapper holds the model as a submodule (:attr:`_model_attr`: ``model``, or ``module`` for the recurrent
    wrappers), which would put that name in front of every key (``model.0.weight``, ``rnn.module.weight_ih_l0``
    where a user did ``model.rnn = spscan.wrap(model.rnn)``): checkpoints saved before wrapping would stop
    loading. Torch's state-dict hooks take the name out (and put it back where a state dict is loaded), so
    that the keys, their order and their version metadata are the model's, also where the wrapper is a
    submodule of the user's model (the parent calls the wrapper's ``state_dict(prefix=...)`` and
    ``_load_from_state_dict``, which run the hooks with that prefix):

    * ``state_dict()``: the model's keys; a checkpoint saved from the wrapper loads into the unwrapped model.
    * ``load_state_dict(sd)``: takes the model's keys (a checkpoint saved before wrapping). Strict mode's
      missing and unexpected keys, and size-mismatch messages, name them as the model's keys. Keys under the
      wrapper's attribute name (a checkpoint saved from a wrapper of an earlier spscan, ``model.0.weight``)
      load too, where the model has nothing of that name (else they are the model's own).
    * ``named_parameters()`` / ``named_buffers()`` / ``named_modules()`` keep the module tree as it is (the
      model under :attr:`_model_attr`): every name there resolves with ``get_parameter``/``get_submodule``
      and names one module; ``parameters()`` are the model's own objects, so optimizers and their state
      dicts (which index parameters by position) are unchanged.
    * ``torch.distributed.checkpoint``'s state dicts: :meth:`_fqn_modifiers` is its protocol for a module
      whose state-dict hooks drop a level.

    Version metadata: a checkpoint's own (``state_dict._metadata``) is read by torch at the model's keys, so
    loading one saved before wrapping reads no version for the model's modules (only ``BatchNorm`` reads
    one: a missing ``num_batches_tracked`` is then taken as the module's present count instead of being
    reported missing).
    """

    #: the attribute holding the wrapped model (one module registered once, under this name)
    _model_attr = "model"

    def _keep_model_keys(self) -> None:
        """Register the state-dict hooks (module-level functions: the wrapper pickles with them)."""
        module: Any = self
        if hasattr(module, "register_state_dict_post_hook"):  # public from torch 2.5
            module.register_state_dict_post_hook(_saved_as_model)
        else:  # pragma: no cover - torch 2.4
            module._register_state_dict_hook(_saved_as_model)
        if hasattr(module, "register_load_state_dict_pre_hook"):  # public from torch 2.5
            module.register_load_state_dict_pre_hook(_load_into_model)
        else:  # pragma: no cover - torch 2.4
            module._register_load_state_dict_pre_hook(_load_into_model, with_module=True)
        module.register_load_state_dict_post_hook(_loaded_as_model)

    def _fqn_modifiers(self) -> dict[str, str]:
        """``torch.distributed.checkpoint``'s map of a state-dict key's first name to the attribute it is under
        (the model's own names: the wrapper's keys have no level of their own)."""
        inner = getattr(self, self._model_attr)
        return {n: self._model_attr for n in (*inner._modules, *inner._parameters, *inner._buffers)}


def _saved_as_model(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: ``prefix + model. + key`` becomes ``prefix + key``, in place and in order (the
    model's keys are the last ones written), with the model's version metadata in place of the wrapper's."""
    inner = prefix + module._model_attr + "."
    moved = [(k, state_dict.pop(k)) for k in [k for k in state_dict if k.startswith(inner)]]
    for k, v in moved:
        state_dict[prefix + k[len(inner):]] = v
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        root = inner[:-1]
        for k in [k for k in meta if k == root or k.startswith(inner)]:
            meta[prefix[:-1] if k == root else prefix + k[len(inner):]] = meta.pop(k)


def _load_into_model(module: Any, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                     missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """Load-state-dict pre-hook: ``prefix + key`` is loaded as ``prefix + model. + key`` (the dict is torch's
    copy, never the caller's). A key already under the wrapper's attribute name, where the model has nothing
    of that name, is a checkpoint of an earlier spscan's wrapper and is loaded as it is. Keeps what
    :func:`_loaded_as_model` needs to name the keys it reports."""
    attr = module._model_attr
    inner = prefix + attr + "."
    model = module._modules.get(attr)
    legacy = model is not None and attr not in model._modules and attr not in model._parameters \
        and attr not in model._buffers
    moved = [(k, state_dict.pop(k)) for k in [k for k in state_dict if k.startswith(prefix)]]
    for k, v in moved:
        state_dict[k if legacy and k.startswith(inner) else inner + k[len(prefix):]] = v
    module.__dict__.setdefault("_spscan_loading", []).append(
        (prefix, len(missing_keys), len(unexpected_keys), error_msgs, len(error_msgs)))


def _loaded_as_model(module: Any, incompatible: Any) -> None:
    """Load-state-dict post-hook: the missing and unexpected keys this wrapper's model reported, and the
    messages it added (size mismatches), name the model's keys (``prefix + key``, not ``prefix + model. + key``)."""
    stack = module.__dict__.get("_spscan_loading")
    if not stack:
        return
    prefix, n_missing, n_unexpected, msgs, n_msgs = stack.pop()
    inner = prefix + module._model_attr + "."
    for keys, start in ((incompatible.missing_keys, n_missing), (incompatible.unexpected_keys, n_unexpected)):
        for i in range(start, len(keys)):
            if keys[i].startswith(inner):
                keys[i] = prefix + keys[i][len(inner):]
    key = re.compile(r"(?<![\w.])" + re.escape(inner) + r"(?=\w)")
    for i in range(n_msgs, len(msgs)):
        msgs[i] = key.sub(lambda _: prefix, msgs[i])
