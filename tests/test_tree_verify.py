"""Tree verification passes: the tree mask, and the KV cache after a partial acceptance."""

from __future__ import annotations

import torch

from engine.checkpoint import load_checkpoint
from engine.kv_cache import KVCache
from engine.spec.tree import DraftTree, ancestors, node_depths, tree_mask, tree_positions
from engine.spec.verify import coupled_verify


def full_logits(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.no_grad():
        return model(x, torch.arange(len(ids))[None]).logits[0]


def prefilled(model, prompt: list[int], batch: int = 1) -> KVCache:
    cache = KVCache.for_model(model.config, batch, 64, model.dtype)
    x = torch.tensor([prompt] * batch)
    with torch.no_grad():
        model(x, torch.arange(len(prompt)).expand(batch, -1), cache=cache)
    cache.lengths[:batch] = len(prompt)
    return cache


def test_ancestors_and_depths_of_a_hand_built_tree():
    parents = torch.tensor([[-1, -1, 0, 2, 1]])
    valid = torch.tensor([[True, True, True, True, False]])
    assert node_depths(parents, valid).tolist() == [[1, 1, 2, 3, 0]]
    anc = ancestors(parents, valid)[0]
    assert anc[4].nonzero().squeeze(1).tolist() == [0, 1, 3, 4]  # node 3: root, node 0, node 2, itself
    assert anc[5].nonzero().squeeze(1).tolist() == [5]  # padding sees only itself


def test_tree_verify_logits_equal_each_path_run_sequentially(hf_folders):
    model = load_checkpoint(hf_folders["qwen3"], dtype=torch.float64)
    prompt, root = [5, 17, 33, 9], 44
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 2, 1]), torch.tensor([0, 6]))
    pt = tree.padded()
    cache = prefilled(model, prompt)
    lengths = cache.lengths[:1]
    pos, slots = tree_positions(pt.depth, lengths)
    mask = tree_mask(pt.parents, pt.valid, lengths, int(lengths.max()) + pt.width + 1)
    entries = torch.cat([torch.tensor([[root]]), pt.tokens], 1)
    with torch.no_grad():
        logits = model(entries, pos, cache=cache, cache_pos=slots, attn_mask=mask).logits[0]
    for i in range(-1, pt.width):  # the root, then every node: compare with its path run alone
        path, j = [], i
        while j >= 0:
            path.insert(0, int(pt.tokens[0, j]))
            j = int(pt.parents[0, j])
        ref = full_logits(model, prompt + [root] + path)[-1]
        assert torch.allclose(logits[i + 1], ref, atol=1e-9), f"entry {i + 1}"


def test_cache_after_partial_acceptance_continues_as_autoregressive_decoding(hf_folders):
    model = load_checkpoint(hf_folders["llama"], dtype=torch.float64)
    prompt, root = [5, 17, 33, 9], 44
    # Two rows with different trees; the "target" accepts node 1 then node 3 in row 0, nothing in row 1.
    tree = DraftTree(torch.tensor([20, 21, 22, 23, 30, 31]), torch.tensor([-1, -1, 0, 1, -1, 0]), torch.tensor([0, 4, 6]))
    pt = tree.padded()
    cache = prefilled(model, prompt, batch=2)
    lengths = cache.lengths[:2]
    pos, slots = tree_positions(pt.depth, lengths)
    mask = tree_mask(pt.parents, pt.valid, lengths, int(lengths.max()) + pt.width + 1)
    entries = torch.cat([torch.tensor([[root], [root]]), pt.tokens], 1)
    with torch.no_grad():
        model(entries, pos, cache=cache, cache_pos=slots, attn_mask=mask)
    target = torch.tensor([[21, 0, 23, 0, 7], [9, 0, 0, 0, 0]])  # row 0: root->21 (node 1)->23 (node 3)->7
    verdict = coupled_verify(pt.tokens, pt.parents, pt.valid, target)
    assert verdict.tokens[0, :3].tolist() == [21, 23, 7] and verdict.tokens[1, :1].tolist() == [9]
    lengths += 1
    cache.commit_path(torch.where(verdict.path >= 0, verdict.path + lengths.unsqueeze(1), 0), verdict.num_accepted)
    assert cache.lengths[:2].tolist() == [len(prompt) + 3, len(prompt) + 1]
    nxt = torch.tensor([[7], [9]])
    with torch.no_grad():
        step = model(nxt, cache.lengths[:2, None], cache=cache).logits[:, -1]
    assert torch.allclose(step[0], full_logits(model, prompt + [root, 21, 23, 7])[-1], atol=1e-9)
    assert torch.allclose(step[1], full_logits(model, prompt + [root, 9])[-1], atol=1e-9)


def test_chain_shortcut_matches_the_general_tree_functions():
    from engine.model import causal_mask
    from engine.spec.tree import DraftTree, node_depths, tree_mask, tree_positions

    tree = DraftTree.chains(torch.tensor([[4, 5, 6, 7], [8, 9, 1, 2]]), lengths=torch.tensor([4, 2]))
    pt = tree.padded()
    assert pt.chain and torch.equal(pt.depth, node_depths(pt.parents, pt.valid))
    lengths = torch.tensor([3, 6])
    _, slots = tree_positions(pt.depth, lengths)
    general = tree_mask(pt.parents, pt.valid, lengths, 12)
    shortcut = causal_mask(slots, 12)
    rows = torch.cat([torch.ones(2, 1, dtype=torch.bool), pt.valid], 1)  # root and real nodes
    assert torch.equal(shortcut[rows], general[rows])


def test_chain_verdicts_equal_the_general_verdict():
    from engine.spec.verify import coupled_chain_verdict

    torch.manual_seed(0)
    for _ in range(20):
        B, N = 4, 6
        tokens = torch.randint(0, 3, (B, N))
        lengths = torch.randint(0, N + 1, (B,))
        valid = torch.arange(N) < lengths.unsqueeze(1)
        parents = torch.where(valid, torch.arange(N) - 1, -1)
        target = torch.randint(0, 3, (B, N + 1))
        general = coupled_verify(tokens, parents, valid, target)
        for short in (coupled_chain_verdict(tokens, valid, target), coupled_verify(tokens, parents, valid, target, chain=True)):
            for name in ("accepted", "num_accepted", "last_index", "path", "tokens", "num_emitted"):
                assert torch.equal(getattr(short, name), getattr(general, name)), name
            assert short.chain and not general.chain


def test_a_chains_kept_layout_equals_the_one_rebuilt_from_its_nodes():
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    cases = [(tokens, None), (tokens, torch.tensor([4, 1, 2])), (tokens, torch.tensor([2, 1, 2])),
             (tokens, torch.tensor([0, 0, 0])), (tokens[:, :0], None)]
    for tokens, lengths in cases:
        tree = DraftTree.chains(tokens, lengths)
        kept = tree.padded()
        tree.layout = None
        rebuilt = tree.padded()
        assert kept.width == rebuilt.width and kept.chain and rebuilt.chain
        for name in ("tokens", "parents", "depth", "valid"):
            assert torch.equal(getattr(kept, name), getattr(rebuilt, name)), (lengths, name)
