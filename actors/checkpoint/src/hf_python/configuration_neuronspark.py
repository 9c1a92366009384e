"""Hugging Face configuration of NeuronSpark spiking language models, as `nsactor export` writes it.

Written for nsactor from the model's specification (nsactor's SPEC and its Rust model); it is
not derived from the authors' code. `nsactor export` copies this file and
`modeling_neuronspark.py` next to `config.json` and names them in its `auto_map`, so that

    AutoConfig.from_pretrained(DIR, trust_remote_code=True)
    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

work on an exported directory. The keys are exactly those of `config.json`: `vocab_size`, `D`
(residual width), `N` (hidden neurons per channel), `K` (SNN frames per token), `num_layers`,
`D_ff` (FFN width), `v_th_min` (V_min of the SNN block's thresholds) and `nsactor_plif_out`
(what the input, FFN and output neurons pass on: `"leak"` = (1 - beta) * V_post, or `"v_post"`).
Defaults are the released 0.9B model.
"""

from transformers import PretrainedConfig

PLIF_OUTPUTS = ("leak", "v_post")


class NeuronSparkConfig(PretrainedConfig):
    """NeuronSpark hyperparameters (defaults: the 0.9B release).

    Args:
        vocab_size: tokens in the vocabulary (the embedding is also the tied output head).
        D: residual stream width.
        N: hidden neurons per channel; the SNN block's state is `D * N` wide.
        K: SNN frames (time steps) per token.
        num_layers: decoder layers.
        D_ff: width of the SNN FFN (its gate and up neurons are `D_ff` each).
        v_th_min: V_min in the SNN block's dynamic threshold `V_th = V_min + |W_th a + b_th|`.
        nsactor_plif_out: `"leak"` (the neurons pass on (1 - beta) * V_post) or `"v_post"`
            (raw V_post), whichever the weights were trained with.
    """

    model_type = "neuronspark"
    keys_to_ignore_at_inference = ["state"]
    # Names the generic Hugging Face tooling looks for.
    attribute_map = {
        "hidden_size": "D",
        "num_hidden_layers": "num_layers",
        "intermediate_size": "D_ff",
    }

    def __init__(
        self,
        vocab_size=6144,
        D=896,
        N=8,
        K=16,
        num_layers=20,
        D_ff=2688,
        v_th_min=0.1,
        nsactor_plif_out="leak",
        bos_token_id=3,
        eos_token_id=4,
        pad_token_id=0,
        **kwargs,
    ):
        if nsactor_plif_out not in PLIF_OUTPUTS:
            raise ValueError(
                f"nsactor_plif_out must be one of {PLIF_OUTPUTS}, got {nsactor_plif_out!r}"
            )
        for name, value in [
            ("vocab_size", vocab_size),
            ("D", D),
            ("N", N),
            ("K", K),
            ("num_layers", num_layers),
            ("D_ff", D_ff),
        ]:
            if int(value) <= 0:
                raise ValueError(f"`{name}` must be positive, got {value}")
        if not v_th_min >= 0.0:
            raise ValueError(f"`v_th_min` must be >= 0, got {v_th_min}")
        self.vocab_size = int(vocab_size)
        self.D = int(D)
        self.N = int(N)
        self.K = int(K)
        self.num_layers = int(num_layers)
        self.D_ff = int(D_ff)
        self.v_th_min = float(v_th_min)
        self.nsactor_plif_out = nsactor_plif_out
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )

    @property
    def state_values_per_row(self):
        """Floats of decoding state per batch row, whatever the context length."""
        return self.num_layers * (2 * self.D + self.D * self.N + 2 * self.D_ff) + self.D
