"""`litqlora kto`: Kahneman-Tversky optimization of a LoRA adapter on unpaired feedback (a prompt, a completion,
desirable or not). `command.py` (the verb and its method object, `KTO`), `args.py` (`--kto.*`, KTOSpec), `loss.py`
(the paper's loss and TRL's metrics), `module.py` (the step: the KL estimate, then the rows), `datamodule.py`."""
