"""The example scripts' code, one subpackage per job a script runs (see docs/architecture.md).

- `generation`: run_generation.py (arguments, prompts, generation config and KV cache, timing, report, --explain,
  continuous batching, multi-process runs).
- `finetuning`: run_lora_clm.py (arguments, Optimum-Habana's options, data, PEFT methods, Trainer, sharding,
  checkpoints and the run record).
- `evaluation`: run_lm_eval.py (`lm_eval`) and attention_fidelity.py (`fidelity`).
- `benchmarks`: the inference, training and continuous-batching benchmarks (models, workers, reports).
- `serving`: `python -m optimum.habana.serve`, transformers' server on the Gaudi classes.
- `common` and `adapters`: what several scripts share.

Nothing in the library's core (`optimum.habana.transformers`, `kernels`, `hpu`, `utils`) imports from here; this
package needs the `examples` extra (`datasets`, `peft`, `tqdm`, `tabulate`, `matplotlib`).
"""
