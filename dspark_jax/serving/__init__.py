"""Serving at scale, simulated (`python -m dspark_jax.simulate`).

* `hardware`: hardware curves (measured SPS tables, a roofline of named accelerators and targets,
  round times reconstructed from a bench_serving run);
* `rounds`: drafter statistics as pools of (survival, accepted length) rounds: recorded from real
  decoding, or synthesised from `python -m dspark_jax.eval`'s JSON;
* `simulator`: the steady-state round loop over the engine's real scheduler functions;
* `validation`: the simulator against a measured bench_serving run;
* `report`: JSON, Markdown and PNG outputs;
* `settings`: the command's settings (one frozen value per subcommand, each flag's field);
* `runs`: the command's runs (simulate, record, validate) from those settings.
"""
