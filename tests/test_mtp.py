"""The Qwen3.5 MTP ("NextN") drafter: lossless greedy and sampled decoding, parity with an
independent cache-free implementation (chained drafts, catch-up after any number of committed
tokens), HF and GGUF layouts, dedicated embeddings, and clear errors for bad checkpoints."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from _engine_util import check_accept_accounting, plain_generate, pooled_chi2, resample_from_p_broken, split_kernel_stand_in
from _mtp_util import ReferenceMTP, build_qwen35, edit_tensors, set_config
from _qwen35_util import write_gguf
from specdec import LLM
from specdec.drafters.base import slice_out
from specdec.drafters.mtp import load_mtp_drafter
from specdec.engine import SpeculativeGenerator
from specdec.errors import CheckpointError, ConfigError
from specdec.loading import load_model
from specdec.sampling import SamplingParams, probs_from_logits

KINDS = ("dense", "moe")
NEW = 64


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """kind -> HF checkpoint directory with an MTP block."""
    return {kind: build_qwen35(tmp_path_factory.mktemp(f"mtp_{kind}"), moe=kind == "moe", seed=2) for kind in KINDS}


@pytest.fixture(scope="module")
def llm(ckpt):
    return {kind: LLM(path, draft="mtp", num_draft_tokens=2, device="cpu") for kind, path in ckpt.items()}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- lossless -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_mtp_greedy_lossless(llm, kind):
    lm = llm[kind]
    model, vocab = lm.model, lm.model.config.vocab_size
    refs = {}
    for k, n in ((1, 7), (2, 1), (3, 23), (4, 7)):  # several prompt lengths, across K
        if n not in refs:
            refs[n] = plain_generate(model, _prompt(n, n, vocab), NEW).token_ids
        prompt, want = _prompt(n, n, vocab), refs[n]
        res = SpeculativeGenerator(model, lm.drafter, k).generate(prompt, NEW, trace=True)
        assert res.token_ids == want, f"{kind}, K={k}, prompt of {n}: MTP output differs from plain greedy"
        check_accept_accounting(prompt, prompt + want, res)
        assert all(len(s["draft"]) == min(k, NEW - 1 - sum(a + 1 for a in res.stats.accepted[:j]))
                   for j, s in enumerate(res.stats.trace)), "the MTP drafter must return k drafts"


def test_llm_api_mtp(ckpt):
    """The user-facing path: LLM(path, draft="mtp", num_draft_tokens=K)."""
    lm = LLM(ckpt["dense"], draft="mtp", num_draft_tokens=3, device="cpu")
    prompt = _prompt(9, 5, lm.model.config.vocab_size)
    res = lm.generate(prompt, max_new_tokens=20)
    assert res.token_ids == plain_generate(lm.model, prompt, 20).token_ids
    assert res.stats.drafted > 0


def _joint_counts(model, drafter, prompt, params, n, k=2, new=3):
    counts = Counter()
    for s in range(n):
        p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=500 + s)
        counts[tuple(SpeculativeGenerator(model, drafter, k).generate(prompt, new, p).token_ids)] += 1
    return counts


def _exact_joint(model, prompt, params, new=3) -> dict:
    """Exact joint of the first ``new`` tokens, over the support only (top-k keeps it small: 27 cells)."""
    out = {(): 1.0}
    for _ in range(new):
        nxt = {}
        for prefix, pr in out.items():
            seq = prompt + list(prefix)
            p = probs_from_logits(model(torch.tensor(seq), model.new_cache(len(seq)), logits="last").logits[-1], params)
            for tok in p.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = pr * float(p[tok])
        out = nxt
    return out


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A dense Qwen3.5 with an MTP block and a vocabulary of 8: the MTP's top-k overlaps the
    target's, so accept, reject and residual paths all carry weight in the statistics."""
    return load_model(build_qwen35(tmp_path_factory.mktemp("mtp_v8"), moe=False, seed=2, vocab=8), "cpu",
                      tokenizer=False)


@pytest.mark.parametrize("case", ["sampled", "static sampled", "argmax", "broken", "draft vocab", "static draft vocab"])
def test_mtp_sampling_lossless(small_vocab, case, monkeypatch):
    """Tokens 1-3 (1 from the prefill, 2-3 verified MTP drafts) follow the target's distribution:
    chi-square p-value above 1e-4 (a 1e-4 false-positive rate per check). "sampled": drafts
    sampled from the MTP's own distribution with their probs; "static sampled": the same from the
    static proposal step (inverse-CDF draws inside it; uncaptured on the CPU); "argmax": argmax
    drafts with probs=None; "broken": a wrong residual rule must fail the same check (the test has power);
    "draft vocab": drafts from 4 of the 8 tokens only (their q is 0 off them: the residual carries the rest)."""
    import specdec.engine.generate as engine_generate

    lm = small_vocab
    drafter = load_mtp_drafter(lm, sample_drafts=case != "argmax")
    if case.endswith("draft vocab"):
        drafter.use_draft_vocab([0, 2, 3, 5])
    if case.startswith("static"):
        drafter.static_steps = drafter.static_sampling = True
        calls = []
        orig = drafter._propose_static
        monkeypatch.setattr(drafter, "_propose_static", lambda *a: calls.append(a[3]) or orig(*a))
    if case == "broken":
        monkeypatch.setattr(engine_generate, "accept_sampled", resample_from_p_broken)
    params = SamplingParams(temperature=1.0, top_k=3)
    # static: a prompt of k + 1 tokens, so that the first proposal's catch-up fits the static step too
    prompt = _prompt(3 if case.startswith("static") else 6, 9, lm.model.config.vocab_size)
    exact = _exact_joint(lm.model, prompt, params)
    counts = _joint_counts(lm.model, drafter, prompt, params,
                           n={"sampled": 300, "static sampled": 300, "argmax": 250, "broken": 200}.get(case, 300))
    if case.startswith("static"):
        assert len(calls) >= 300 and all(p is not None and not p.greedy for p in calls), "the static sampled step did not draft"
    assert set(counts) <= set(exact), "a token outside the target's top-k was emitted"
    keys = sorted(exact)
    c = torch.tensor([counts.get(key, 0) for key in keys], dtype=torch.float64)
    p = torch.tensor([exact[key] for key in keys], dtype=torch.float64)
    stat, df, pv = pooled_chi2(c, p)
    assert df >= 10, "too few cells for a meaningful test"
    if case == "broken":
        assert pv < 1e-6, f"the broken rule went unnoticed (p={pv:.2e})"
    else:
        assert pv > 1e-4, f"MTP sampling deviates from the target (chi2={stat:.1f}, df={df}, p={pv:.2e})"


def test_static_sampled_proposal_draws_from_the_q_it_returns(small_vocab):
    """The static sampled proposal's drafts are the inverse-CDF draws of the uniforms it took from
    the request's generator, from the very ``q`` rows it returns (acceptance divides by those), and
    those rows are the block's filtered distributions at its own drafts."""
    from specdec.sampling import sample_inverse_cdf
    lm = small_vocab
    drafter = load_mtp_drafter(lm)
    drafter.static_steps = drafter.static_sampling = True
    params = SamplingParams(temperature=0.9, top_k=4, seed=3)
    prompt = _prompt(3, 4, lm.model.config.vocab_size)
    cache = lm.model.new_cache(64)
    drafter.begin(torch.tensor(prompt), lm.model(torch.tensor(prompt), cache, logits="last"))
    gen = torch.Generator().manual_seed(11)
    prop = drafter.propose(5, 2, params, gen)
    step = drafter._static[(2, 0.9, 4, 1.0)]
    assert prop.probs.shape == (2, lm.model.config.vocab_size)
    assert torch.equal(prop.tokens, sample_inverse_cdf(prop.probs, step.u))
    torch.testing.assert_close(prop.probs, probs_from_logits(drafter.last_logits, params))
    assert torch.equal(step.u, torch.rand(2, generator=torch.Generator().manual_seed(11)))


# --- parity with an independent implementation --------------------------------------------------

def _parity_run(lm, drafter, ref, params, steps=8, seed=0):
    """Drive the drafter like the engine, with arbitrary commits, checking every proposal."""
    model, vocab = lm.model, lm.model.config.vocab_size
    rng = torch.Generator().manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    committed = _prompt(11, seed, vocab)
    cache = model.new_cache(256)
    drafter.begin(torch.tensor(committed), model(torch.tensor(committed), cache, logits="last"))
    t = int(torch.randint(vocab, (1,), generator=rng))
    for step, k in enumerate([3, 1, 4, 0, 2, 4, 3, 1][:steps]):
        drafts = []
        if k:
            prop = drafter.propose(t, k, params, gen if not params.greedy else None)
            drafts = prop.tokens.tolist()
            full = torch.tensor(committed)
            hidden = model(full, model.new_cache(len(committed)), logits="none").hidden
            ref_drafts, ref_logits = ref.chain(hidden, committed + [t], k, forced=None if params.greedy else drafts)
            assert drafts == ref_drafts, f"step {step}: drafts {drafts} vs reference {ref_drafts}"
            torch.testing.assert_close(drafter.last_logits.double(), ref_logits, atol=1e-4, rtol=1e-4)
            if not params.greedy and prop.probs is not None:
                want = probs_from_logits(ref_logits.float(), params)
                torch.testing.assert_close(prop.probs, want, atol=1e-5, rtol=1e-4)
        # commit n of the verified tokens: the drafts themselves on even steps, other tokens on odd
        # ones (the drafter must not assume its drafts were right)
        ids = [t] + (drafts if step % 2 == 0 else torch.randint(vocab, (k,), generator=rng).tolist())
        n = int(torch.randint(len(ids), (1,), generator=rng))
        start = cache.length
        out = model(torch.tensor(ids), cache)
        cache.rollback(start + n + 1)
        drafter.observe(torch.tensor(ids[:n + 1]), slice_out(out, n + 1))
        committed += ids[:n + 1]
        t = int(torch.randint(vocab, (1,), generator=rng))


@pytest.mark.parametrize("kind", KINDS)
def test_mtp_matches_reference(ckpt, llm, kind):
    lm = llm[kind]
    ref = ReferenceMTP(ckpt[kind])
    _parity_run(lm, lm.drafter, ref, SamplingParams())
    _parity_run(lm, lm.drafter, ref, SamplingParams(temperature=0.9, top_p=0.95), seed=3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", [True, False])
def test_split_catch_up(ckpt, llm, kind, split, monkeypatch):
    """SPECDEC_MTP_SPLIT_CATCHUP: a propose with more committed rows than the static step takes (a prompt's first,
    one after a step without a propose) runs the older rows eagerly and the last k + 1 through the static step
    (uncaptured on the CPU): drafts and logits as the reference's, every propose on the static step (without the
    switch such proposes run the eager chain), and greedy output equal to plain decoding's."""
    from specdec.drafters import mtp
    monkeypatch.setattr(mtp, "SPLIT_CATCHUP", split)
    lm = llm[kind]
    drafter = load_mtp_drafter(lm.loaded)
    drafter.static_steps = True
    calls, orig = [], drafter._propose_static
    monkeypatch.setattr(drafter, "_propose_static", lambda *a, **kw: calls.append(a[0].shape[0]) or orig(*a, **kw))
    _parity_run(lm, drafter, ReferenceMTP(ckpt[kind]), SamplingParams())  # 7 proposes, the first after 11 rows
    assert (len(calls) == 7) == split, f"{len(calls)} of 7 proposes on the static step"
    vocab = lm.model.config.vocab_size
    prompt = _prompt(23, 23, vocab)
    res = SpeculativeGenerator(lm.model, drafter, 3).generate(prompt, NEW)
    assert res.token_ids == plain_generate(lm.model, prompt, NEW).token_ids


def test_cache_growth_keeps_chained_rows(ckpt, llm):
    """A cache that must grow in the middle of a chain keeps the rows of that chain."""
    lm = llm["dense"]
    drafter = load_mtp_drafter(lm.loaded)
    ref = ReferenceMTP(ckpt["dense"])
    model = lm.model
    committed = _prompt(31, 4, model.config.vocab_size)  # begin sizes the cache to 2 * 31 = 62 < 64
    drafter.begin(torch.tensor(committed), model(torch.tensor(committed), model.new_cache(64), logits="last"))
    # room for the 31 committed rows and 2 chained ones: the cache grows in the middle of the chain
    drafter.cache = drafter.block.layers[0].make_cache(33, model.dtype, model.device)
    k = 8
    prop = drafter.propose(5, k, SamplingParams(), None)
    hidden = model(torch.tensor(committed), model.new_cache(64), logits="none").hidden
    want, logits = ref.chain(hidden, committed + [5], k)
    assert drafter.cache.k.shape[1] > 33, "the cache should have grown"
    assert prop.tokens.tolist() == want
    torch.testing.assert_close(drafter.last_logits.double(), logits, atol=1e-4, rtol=1e-4)


def test_dedicated_embeddings_and_head(ckpt, tmp_path):
    """mtp_use_dedicated_embeddings: the block embeds with mtp.embed_tokens (and projects with
    mtp.shared_head.head, GGUF nextn.shared_head_head, when present), not the target's tables."""
    path = str(tmp_path / "ded")
    shutil.copytree(ckpt["dense"], path)

    def add(t):
        t["mtp.embed_tokens.weight"] = torch.randn_like(t["model.embed_tokens.weight"])
        t["mtp.shared_head.head.weight"] = torch.randn_like(t["lm_head.weight"]) * 0.05
    edit_tensors(path, add)
    set_config(path, mtp_use_dedicated_embeddings=True)
    lm = load_model(path, "cpu", tokenizer=False)
    drafter = load_mtp_drafter(lm)
    assert drafter.block.embed_tokens is not None and drafter.block.shared_head is not None
    own = ReferenceMTP(path, embed_name="mtp.embed_tokens.weight", head_name="mtp.shared_head.head.weight")
    _parity_run(lm, drafter, own, SamplingParams(), steps=4)
    for wrong in (ReferenceMTP(path, head_name="mtp.shared_head.head.weight"),  # target's embedding
                  ReferenceMTP(path, embed_name="mtp.embed_tokens.weight")):  # target's head
        with pytest.raises(AssertionError):  # the check tells the tables apart
            _parity_run(lm, drafter, wrong, SamplingParams(), steps=4)


# --- GGUF -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_gguf_nextn_layout_matches_hf(ckpt, llm, kind, tmp_path):
    gpath = str(tmp_path / f"{kind}.gguf")
    write_gguf(ckpt[kind], gpath)
    g = load_model(gpath, "cpu", tokenizer=False)  # the tiny GGUF carries no tokenizer
    assert g.format == "gguf"
    g_drafter = load_mtp_drafter(g)
    h = llm[kind]
    for name, p in g_drafter.block.state_dict().items():
        torch.testing.assert_close(p, h.drafter.block.state_dict()[name], atol=1e-6, rtol=0, msg=name)
    prompt = _prompt(13, 1, g.model.config.vocab_size)
    a = SpeculativeGenerator(g.model, g_drafter, 3).generate(prompt, 40, trace=True)
    b = SpeculativeGenerator(h.model, h.drafter, 3).generate(prompt, 40, trace=True)
    assert a.token_ids == b.token_ids
    assert [s["draft"] for s in a.stats.trace] == [s["draft"] for s in b.stats.trace]


def test_gguf_missing_nextn_tensor_is_named(ckpt, tmp_path):
    gpath = str(tmp_path / "bad.gguf")
    write_gguf(ckpt["dense"], gpath, drop="blk.4.nextn.eh_proj.weight")
    lm = load_model(gpath, "cpu", tokenizer=False)
    with pytest.raises(CheckpointError, match=r"blk\.4\.nextn\.eh_proj\.weight"):
        load_mtp_drafter(lm)


# --- acceptance is possible -------------------------------------------------------------------------

def test_perfect_mtp_gives_full_blocks(ckpt, tmp_path):
    """A (degenerate) MTP that always agrees with its target: every step accepts all K drafts.

    Both final norms are set to 1 + w = 0, so the target's and the MTP's hidden states are zero,
    all logits are 0 and both predict token 0 (argmax's first index) everywhere."""
    path = str(tmp_path / "perfect")
    shutil.copytree(ckpt["moe"], path)

    def zero_norms(t):
        t["model.norm.weight"] = -torch.ones_like(t["model.norm.weight"])
        t["mtp.norm.weight"] = -torch.ones_like(t["mtp.norm.weight"])
    edit_tensors(path, zero_norms)
    lm = LLM(path, draft="mtp", device="cpu")
    for k in (1, 3, 4):
        res = SpeculativeGenerator(lm.model, lm.drafter, k).generate([1, 2, 3], 25)
        assert res.token_ids == [0] * 25
        assert res.stats.accepted[:-1] == [k] * (len(res.stats.accepted) - 1)
        assert res.stats.tau > 1


# --- bad checkpoints ------------------------------------------------------------------------------

def _broken(ckpt, tmp_path, edit=None, **config):
    path = str(tmp_path / "broken")
    shutil.copytree(ckpt["dense"], path)
    if edit is not None:
        edit_tensors(path, edit)
    if config:
        set_config(path, **config)
    return load_model(path, "cpu", tokenizer=False)


def test_missing_fc_is_named(ckpt, tmp_path):
    lm = _broken(ckpt, tmp_path, lambda t: t.pop("mtp.fc.weight"))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight"):
        load_mtp_drafter(lm)


def test_wrong_shape_is_named(ckpt, tmp_path):
    lm = _broken(ckpt, tmp_path, lambda t: t.__setitem__("mtp.fc.weight", t["mtp.fc.weight"][:, :64].clone()))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight.*shape"):
        load_mtp_drafter(lm)


def test_integer_tensor_is_named(ckpt, tmp_path):
    lm = _broken(ckpt, tmp_path, lambda t: t.__setitem__("mtp.norm.weight", t["mtp.norm.weight"].to(torch.int32)))
    with pytest.raises(CheckpointError, match=r"mtp\.norm\.weight.*float"):
        load_mtp_drafter(lm)


def test_unexpected_mtp_tensor_is_named(ckpt, tmp_path):
    lm = _broken(ckpt, tmp_path, lambda t: t.__setitem__("mtp.layers.0.bogus.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.bogus\.weight"):
        load_mtp_drafter(lm)


def test_dedicated_embeddings_flag_without_tensor(ckpt, tmp_path):
    lm = _broken(ckpt, tmp_path, mtp_use_dedicated_embeddings=True)
    with pytest.raises(CheckpointError, match=r"mtp_use_dedicated_embeddings.*mtp\.embed_tokens\.weight"):
        load_mtp_drafter(lm)


def test_checkpoint_without_mtp_block(tmp_path):
    path = build_qwen35(tmp_path / "nomtp", moe=False, mtp=False)
    with pytest.raises(CheckpointError, match="no MTP block"):
        LLM(path, draft="mtp", device="cpu")


def test_mtp_on_a_target_without_mtp(tmp_path):
    from _engine_util import build_llama

    path = build_llama(tmp_path / "llama")
    with pytest.raises(ConfigError, match="MTP"):
        LLM(path, draft="mtp", device="cpu")


def test_two_mtp_layers_rejected(ckpt, tmp_path):
    lm = _broken(ckpt, tmp_path, mtp_num_hidden_layers=2)
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers=2"):
        load_mtp_drafter(lm)


def test_static_sampled_steps_kept_per_params(small_vocab):
    """Sampled static proposals are kept per k for one set of sampling params (reused by the next
    request with the same params); other params replace them, the greedy steps stay."""
    lm = small_vocab
    drafter = load_mtp_drafter(lm)
    drafter.static_steps = drafter.static_sampling = True
    prompt = _prompt(3, 4, lm.model.config.vocab_size)
    gen = SpeculativeGenerator(lm.model, drafter, 2)
    a, b = SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.7, seed=2)
    gen.generate(prompt, 6, SamplingParams())
    gen.generate(prompt, 6, a)
    first = {kk: st for kk, st in drafter._static.items() if isinstance(kk, tuple)}
    gen.generate(prompt, 6, SamplingParams(temperature=0.9, seed=5))
    assert first and all(drafter._static[kk] is st for kk, st in first.items())  # reused
    gen.generate(prompt, 6, b)
    keys = list(drafter._static)
    assert any(kk == 2 for kk in keys)  # the greedy step stays
    assert all(kk[1] == 0.7 for kk in keys if isinstance(kk, tuple))


@pytest.mark.parametrize("split", [False, True])
def test_static_propose_with_the_split_attention(ckpt, monkeypatch, split):
    """SPECDEC_DRAFTER_SPLIT=1: the static propose's attention (the catch-up rows and each chained
    row, over the whole cache, masked) takes the split kernel (here its torch form): the drafts'
    logits are the eager propose's and greedy output still equals plain decoding."""
    lm = load_model(ckpt["dense"], "cpu", tokenizer=False)
    calls = split_kernel_stand_in(monkeypatch) if split else []
    prompt = _prompt(11, 3, lm.model.config.vocab_size)
    runs = {}
    for static in (False, True):
        drafter = load_mtp_drafter(lm)
        drafter.static_steps = static
        logits, propose = [], drafter.propose

        def spy(*a, drafter=drafter, logits=logits, propose=propose):
            prop = propose(*a)
            logits.append(drafter.last_logits.clone())
            return prop

        drafter.propose = spy
        runs[static] = (SpeculativeGenerator(lm.model, drafter, 3).generate(prompt, 24).token_ids, logits)
    assert runs[True][0] == runs[False][0] == plain_generate(lm.model, prompt, 24).token_ids
    assert len(runs[True][1]) == len(runs[False][1]) > 3
    for a, b in zip(*(runs[s][1] for s in (False, True))):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert (len(calls) > 0) == split  # the static steps' attention went through the kernel
