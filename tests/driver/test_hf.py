"""Hugging Face models as users bring them: built from a config with the library's own init, trained in
Spark from a DataFrame of token ids. The tests that build one need the `[hf]` extra (transformers):
where it is absent they are reported as skipped; .ci/run installs it, so CI runs them."""

import numpy as np
import pytest
import torch
from torch import nn

from gradshare import SharedTrainer
from gradshare.config.options import Network
from gradshare.replica.losses import InputTypeError, plan_loss

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1", advertise_host="127.0.0.1"), verbose=0)
VOCAB, SEQ, PAD = 48, 12, 0


def model_and_step():
    """The model factory and the train step, made inside a function: Spark's closure then carries them by
    value (a test module's top-level functions would be pickled by a module name executors cannot import)."""

    def tiny_llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=PAD,
        )
        return LlamaForCausalLM(config)

    def hf_step(model, batch):
        ids, mask, labels = batch
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    return tiny_llama, hf_step


def token_rows(n=96, seed=0):
    """Sequences counting up mod VOCAB from a random start (learnable), the last few padded in some rows:
    (input_ids, attention_mask, labels with -100 at the padding), as HF's data collators make them."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(1, VOCAB, n)
    ids = 1 + (starts[:, None] + np.arange(SEQ)) % (VOCAB - 1)
    lengths = rng.integers(SEQ - 3, SEQ + 1, n)
    mask = (np.arange(SEQ) < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, ids, PAD)
    labels = np.where(mask == 1, ids, -100)
    return ids, mask, labels


def test_hf_llama_trains_from_a_dataframe_and_saves_with_save_pretrained(spark, tmp_path):
    transformers = pytest.importorskip("transformers")
    tiny_llama, hf_step = model_and_step()
    ids, mask, labels = token_rows()
    df = spark.createDataFrame(
        [(i.tolist(), m.tolist(), y.tolist()) for i, m, y in zip(ids, mask, labels)],
        ["input_ids", "attention_mask", "labels"],
    ).repartition(2)
    result = SharedTrainer(
        tiny_llama,
        train_step=hf_step,
        epochs=3,
        batch_size=8,
        seed=3,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        **LOOPBACK,
    ).fit(df, features_col=["input_ids", "attention_mask"], label_col="labels")
    assert result.world_size == 2
    assert {r["param_hash"] for r in result.worker_reports} == {result.param_hash}  # one model, bit for bit
    model = result.model
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    batch = tuple(torch.from_numpy(a) for a in (ids, mask, labels))
    torch.manual_seed(3)
    with torch.no_grad():
        assert float(hf_step(model.eval(), batch)) < float(hf_step(tiny_llama().eval(), batch)) - 0.3  # it learned
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=batch[0]).logits, model(input_ids=batch[0]).logits)


def test_the_default_loss_reads_a_model_outputs_logits():
    pytest.importorskip("transformers")
    tiny_llama, _ = model_and_step()
    ids, _, _ = token_rows(2, seed=1)
    sample = ((ids[0, :-1],), ids[0, 1:])  # next-token labels (T,) for logits (B, T, V)
    plan = plan_loss(tiny_llama(), sample, "int", True)
    assert (plan.name, plan.label_dtype, plan.probe) == ("CrossEntropyLoss", "int64", f"output (B, {SEQ - 1}, {VOCAB})")
    batch = tuple(torch.from_numpy(a[None]) for a in (ids[0, :-1], ids[0, 1:]))
    assert torch.isfinite(plan.step(tiny_llama(), batch))  # the class-last logits of a ModelOutput


class Outputs(nn.Module):
    """A model that returns a dict without logits, as a multi-task head might."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        return {"scores": self.layer(x), "aux": x.sum()}


def test_a_mapping_without_logits_names_train_step_before_any_task():
    sample = ((np.zeros(4, np.float32),), np.asarray(1))
    with pytest.raises(InputTypeError, match=r"dict with no 'logits' tensor \(keys: 'scores', 'aux'\).*train_step="):
        plan_loss(Outputs(), sample, "int", True)

    # a dict that has logits is read as its logits: the default loss and its shape check apply
    class WithLogits(Outputs):
        def forward(self, x):
            return {"logits": self.layer(x)}

    assert plan_loss(WithLogits(), sample, "int", True).probe == "output (B, 3)"


def test_ragged_token_ids_name_the_column_and_the_lengths(spark):
    df = spark.createDataFrame([([1, 2, 3], 0), ([4, 5], 1), ([6, 7, 8], 0)], ["input_ids", "label"]).coalesce(1)
    with pytest.raises(
        ValueError,
        match=r"row 1: column 'input_ids' of shape \(2,\) differ from the first row's "
        r"\(3,\): every row of an array column needs the same length",
    ):
        SharedTrainer(
            lambda: nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)), num_workers=1, **LOOPBACK
        ).fit(df, features_col="input_ids", label_col="label")


def test_spark_ml_estimator_with_an_hf_classifier_predicts_from_its_logits(spark):
    pytest.importorskip("transformers")
    from gradshare.ml import GradshareEstimator

    def classifier():
        from transformers import LlamaConfig, LlamaForSequenceClassification

        return LlamaForSequenceClassification(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=SEQ,
                num_labels=3,
                pad_token_id=PAD,
                bos_token_id=None,
                eos_token_id=None,
            )
        )

    ids, _, _ = token_rows(96, seed=2)
    labels = ids[:, 0] % 3
    df = spark.createDataFrame([(a.tolist(), int(c)) for a, c in zip(ids, labels)], ["input_ids", "label"]).repartition(
        2
    )
    model = GradshareEstimator(
        classifier,
        featuresCol="input_ids",
        labelCol="label",
        epochs=1,
        batchSize=16,
        numWorkers=2,
        trainerOptions=LOOPBACK,
    ).fit(df)
    assert model.isClassifier  # the default loss read the ModelOutput's (B, 3) logits
    rows = model.transform(df).select("input_ids", "prediction", "probability").collect()
    xs = torch.tensor([r["input_ids"] for r in rows])
    with torch.no_grad():
        logits = model.torchModel.eval()(xs).logits
    assert [r["prediction"] for r in rows] == logits.argmax(dim=1).double().tolist()
    np.testing.assert_allclose([list(r["probability"]) for r in rows], torch.softmax(logits, 1).numpy(), rtol=1e-5)
