"""Runs inside vLLM's worker processes (`worker_extension_cls`): weight pushes into the served model.

vLLM mixes this class into its worker, so `self.model_runner` is the worker's model runner: its
`model` is the target, its `drafter` (an EAGLE proposer) holds the drafter as `drafter.model`.
`LLM.collective_rpc("tailspec_load_weights", args=(paths,))` calls it on every worker. A push
arrives as safetensors files (its buckets, written to shared memory by the caller): vLLM's RPC
between its front end and engine core cannot carry tensors (they reach the core as memoryviews
that it then fails to pickle to the workers). Both loaders are vLLM's own `load_weights`, which
take Hugging Face names (the target's as in its safetensors; the drafter's as in the export:
`fc.weight`, `layers.0.*`) and copy in place, so the drafter keeps sharing the target's embedding
and LM head. This module imports nothing from TailSpec: vLLM's processes only need it on their path.
"""

from __future__ import annotations


def _read(paths: list[str]):
    """The (name, tensor) pairs of the bucket files, one file in memory at a time."""
    from safetensors.torch import load_file

    for path in paths:
        yield from load_file(path).items()


class TailSpecWorkerExtension:
    def tailspec_load_weights(self, paths: list[str]) -> None:
        """The target's new weights, through vLLM's in-place reload: on CPU vLLM repacks linear
        weights after loading (the checkpoint-shaped parameters are left empty), so a plain
        load_weights cannot reach them; reload re-runs that processing layer by layer."""
        self.model_runner.reload_weights(weights_iterator=_read(paths), is_checkpoint_format=True)
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(model.config, "tie_word_embeddings", False):
            # A tied head gets no weights of its own, so the reload does not re-process it: on CPU
            # its packed copy (oneDNN) would keep serving the old embedding. Re-pack it from the new one.
            head.quant_method.process_weights_after_loading(head)

    def tailspec_load_drafter_weights(self, paths: list[str]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        drafter = getattr(self.model_runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "model"):
            raise RuntimeError("this vLLM engine has no model drafter (speculative_config method eagle) to load into")
        model = drafter.model
        initialize_layerwise_reload(model)
        model.load_weights(_read(paths))
        finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)

