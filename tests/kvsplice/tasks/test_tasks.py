"""Tests for kvsplice.tasks: the generated long-context tasks (lengths in the model's tokens, determinism, the answers
in the text), exact-match scoring, and the runner — both settings through both doors (the package's Decoder and
transformers' generate() with KVSpliceHFCache) give the same tokens and the same measured bytes, which equal the
method's closed form; a selection that keeps everything answers exactly as the full cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tiny_models import tiny_family  # noqa: E402

from kvsplice.core.build import build_method  # noqa: E402
from kvsplice.quant.method import KIVI  # noqa: E402
from kvsplice.quant.rotated import RotatedKIVI  # noqa: E402
from kvsplice.tasks.methods import parse_method  # noqa: E402
from kvsplice.tasks.instance import match_score, settled  # noqa: E402
from kvsplice.tasks.runner import answer  # noqa: E402
from kvsplice.tasks.suite import TASKS, check_positions, make_instance, make_instances  # noqa: E402

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
GPT2_TOK = DATA / "gpt2_tokenizer"

pytestmark = pytest.mark.skipif(not (STORIES.is_file() and (GPT2_TOK / "encoder.json").is_file()),
                                reason=f"TinyStories text / GPT-2 tokenizer not found under {DATA}")


@pytest.fixture(scope="module")
def tok():
    from kvsplice.loading import load_tokenizer

    return load_tokenizer(GPT2_TOK)


@pytest.fixture(scope="module")
def model():
    m = tiny_family("llama", vocab_size=50257, n_layer=2)
    m.config.max_position_embeddings = 4096
    return m


@pytest.mark.parametrize("task", sorted(TASKS))
def test_make_instance_length_and_answers(tok, task) -> None:
    for length in (512, 2048):
        inst = make_instance(task, tok, length, 3, stories=str(STORIES))
        n = inst.meta["n_tokens"]
        assert length - 160 <= n <= length, (task, length, n)  # within a haystack piece (a story paragraph)
        text = inst.context
        for a in inst.answers:
            assert a in text, (task, a)
        assert inst.score(" ".join(inst.answers)) == 1.0
    again = make_instance(task, tok, 512, 3, stories=str(STORIES))
    assert again.context == make_instance(task, tok, 512, 3, stories=str(STORIES)).context  # a function of the seed
    assert make_instance(task, tok, 512, 4, stories=str(STORIES)).context != again.context


def test_make_instance_common_words_are_most_common(tok) -> None:
    inst = make_instance("common_words", tok, 1024, 0, stories=str(STORIES))
    words = [e.split(". ", 1)[1] for e in inst.context.split("\n", 1)[1].split(" ") if ". " in e] or \
        inst.context.split("\n", 1)[1].split()[1::2]
    counts = {w: words.count(w) for w in set(words)}
    rest = max(c for w, c in counts.items() if w not in inst.answers)
    assert len(inst.answers) == 10 and min(counts[a] for a in inst.answers) > rest


def test_make_instance_refuses_bad_input(tok) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        make_instance("nope", tok, 512, 0)
    with pytest.raises(ValueError, match="needs a TinyStories file"):
        make_instance("story_qa", tok, 512, 0)
    with pytest.raises(ValueError, match="too short"):
        make_instance("common_words", tok, 100, 0, stories=str(STORIES))
    assert len(make_instances(["passkey", "vartrack"], tok, [256, 512], 2)) == 8


def test_check_positions_leaves_room_for_the_answer(tok) -> None:
    insts = make_instances(["passkey"], tok, [256], 1)
    new = insts[0].max_new_tokens
    check_positions(insts, 256 + new)  # the prompt and its answer fit exactly
    check_positions(insts, None)  # no limit
    with pytest.raises(ValueError, match=f"passkey at length 256: its prompt \\+ {new} answer tokens exceed the "
                                         f"model's 256 positions \\(give lengths of at most {256 - new}\\)"):
        check_positions(insts, 256)


def test_settled_only_where_more_text_cannot_change_the_score() -> None:
    for text, answers, want in [(" 12345.", ["12345"], True), (" 12345", ["12345"], False),  # "123456" may follow
                                (" 12345 and 6", ["12345", "6"], False), (" 12345, 6.", ["12345", "6"], True),
                                (" 1234", ["12345"], False), (" the pass key", ["12345"], False)]:
        assert settled(text, answers) is want
        if want:  # whatever is appended, the score is the same
            assert all(match_score(text + more, answers) == match_score(text, answers) for more in ("7", "x", ""))


def test_match_score() -> None:
    assert match_score("The pass key is 12345.", ["12345"]) == 1.0
    assert match_score("The pass key is 123456.", ["12345"]) == 0.0  # not inside a longer number
    assert match_score("ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO", "PQRST"]) == 0.5
    with pytest.raises(ValueError):
        match_score("x", [])


def _factory(spec):
    return lambda ids: build_method(spec, prompt_len=ids.shape[1])


@pytest.mark.parametrize("setting", ["agnostic", "aware"])
def test_answer_doors_agree(tok, model, setting) -> None:
    inst = make_instance("niah_number_stories", tok, 256, 0, stories=str(STORIES))
    methods = {"full": lambda ids: None,
               "obs+int8": _factory("select:observed_attention@0.25+int8"),
               "snapkv": _factory("select:snapkv@0.5"),
               "expected_attention": _factory("select:expected_attention@0.5"),
               "kivi4": lambda ids: KIVI(bits=4, group=16, residual=16),
               "kivi4h": lambda ids: RotatedKIVI(bits=4, group=16, residual=16),
               "kvzip+int8": parse_method("select:kvzip@x4+int8", tok).factory}
    for name, f in methods.items():
        a = answer(model, tok, inst, f, setting=setting, door="decoder")
        b = answer(model, tok, inst, f, setting=setting, door="hf")
        assert a.tokens == b.tokens and len(a.tokens) > 0, name
        assert a.cache_bytes == b.cache_bytes == a.formula_bytes == b.formula_bytes, name
        assert a.n_compressed == (a.n_prompt if setting == "aware" else a.n_prompt - len(tok.encode(inst.question)))
        if name == "full":
            assert a.fp16_bytes == a.full_fp16_bytes
        else:
            assert a.fp16_bytes < a.full_fp16_bytes


def test_answer_full_budget_selection_is_the_full_cache(tok, model) -> None:
    inst = make_instance("vartrack", tok, 256, 1)
    full = answer(model, tok, inst, lambda ids: None, setting="agnostic")
    keep_all = answer(model, tok, inst, _factory("select:observed_attention@1.0"), setting="agnostic")
    assert keep_all.tokens == full.tokens and keep_all.score == full.score
    with pytest.raises(ValueError, match="setting"):
        answer(model, tok, inst, lambda ids: None, setting="both")


@pytest.mark.parametrize("setting", ["agnostic", "aware"])
def test_answer_many_equals_answer(tok, model, setting) -> None:
    from kvsplice.tasks.shared import answer_many

    inst = make_instance("multikey_facts", tok, 200, 2)
    specs = {s: parse_method(s, tok) for s in ("full", "select:observed_attention@x4+int8", "select:kvzip@x2",
                                                "select:kvzip@x4+int8", "int8", "select:snapkv@0.5",
                                                # the mixed-in votes made once for the context, then reused
                                                "select:kvzip(mix=observed_attention,share=0.25)@x4+int8",
                                                "select:kvzip(mix=observed_attention,share=0.5)@x2",
                                                "select:kvzip(mix=observed_attention,heads=pooled)@x4+int8")}
    many = answer_many(model, tok, inst, {s: m.factory for s, m in specs.items()}, setting=setting)
    assert list(many) == list(specs)
    for s, m in specs.items():
        one = answer(model, tok, inst, m.factory, setting=setting)
        assert many[s].tokens == one.tokens, s
        assert (many[s].cache_bytes, many[s].formula_bytes, many[s].fp16_bytes) == \
            (one.cache_bytes, one.formula_bytes, one.fp16_bytes), s
    assert many["select:kvzip@x2"].cache_bytes > many["select:kvzip@x4+int8"].cache_bytes


def test_answer_many_score_only_keeps_every_score_and_cuts_only_after_it_settles(tok, model) -> None:
    from kvsplice.tasks.instance import settled
    from kvsplice.tasks.shared import answer_many

    specs = {s: parse_method(s, tok) for s in ("full", "select:kvzip@x2", "select:observed_attention@x4+int8")}
    for seed in range(3):
        inst = make_instance("passkey", tok, 200, seed)
        whole = answer_many(model, tok, inst, {s: m.factory for s, m in specs.items()})
        cut = answer_many(model, tok, inst, {s: m.factory for s, m in specs.items()}, score_only=True)
        for s in specs:
            assert cut[s].score == whole[s].score and whole[s].tokens[:len(cut[s].tokens)] == cut[s].tokens, s
            assert cut[s].tokens == whole[s].tokens or settled(cut[s].output, inst.answers), s


def test_shared_prefill_answers_every_method_as_often_as_asked(tok, model) -> None:
    """One kept prefill answers the full cache and any method, again and again, as answer() does alone."""
    from kvsplice.tasks.shared import SharedPrefill

    inst = make_instance("passkey", tok, 200, 1)
    one = SharedPrefill(model, tok, inst)
    assert one.replays and one.nbytes > 0
    full = one.full()
    assert full is one.full() and full.tokens == answer(model, tok, inst, lambda ids: None).tokens
    for spec in ("select:kvzip(mix=observed_attention,share=0.5)@x4+int8", "int8"):
        f = parse_method(spec, tok).factory
        again = [one.answer(f) for _ in range(2)]
        assert again[0].tokens == again[1].tokens == answer(model, tok, inst, f).tokens, spec
    assert any(one.shared["mix_votes"].values())  # KVzip kept its votes (and reconstruction scores) for the context


def test_tuning_tasks_scores_equal_answer_many_kept_or_not(tok, model) -> None:
    """The planner's bench: each instance's score is answer_many's (score_only), whether its prefill is kept or made
    again on every use (keep_bytes=0); the full cache's accuracy is its mean."""
    from kvsplice.tasks.shared import answer_many
    from kvsplice.tasks.tuning import TuningTasks

    insts = make_instances(["passkey", "vartrack"], tok, [200], 2)
    specs = {s: parse_method(s, tok).factory for s in ("select:kvzip(mix=observed_attention,share=0.25)@x8",
                                                      "select:observed_attention@x8")}
    want = [answer_many(model, tok, i, {"full": lambda ids: None, **specs}, score_only=True) for i in insts]
    for keep in (1 << 40, 0):
        bench = TuningTasks(model, tok, insts, progress=False, keep_bytes=keep)
        assert bench.n == len(insts)
        assert bench.full() == pytest.approx(100 * sum(w["full"].score for w in want) / len(insts))
        for s, f in specs.items():
            assert list(bench.scores(f, s)) == [w[s].score for w in want], (keep, s)
        assert (len(bench._kept) == len(insts)) == (keep > 0)
        bench.close()


def test_answer_many_on_a_model_that_cannot_replay_answers_each_alone(tok) -> None:
    """A sliding-window model (the Decoder evicts as it goes: no prefill to replay): every method, the full cache
    and a selection too, answers through its own prefill — the same tokens as answer() alone."""
    from kvsplice.tasks.shared import SharedPrefill, answer_many

    m = tiny_family("mistral", vocab_size=50257, n_layer=2, window=64)
    m.config.max_position_embeddings = 4096
    inst = make_instance("passkey", tok, 200, 0)
    specs = {s: parse_method(s, tok) for s in ("full", "int8", "select:observed_attention@x2")}
    assert not SharedPrefill(m, tok, inst).replays
    many = answer_many(m, tok, inst, {s: x.factory for s, x in specs.items()})
    for s, x in specs.items():
        assert many[s].tokens == answer(m, tok, inst, x.factory).tokens, s
