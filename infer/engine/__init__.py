"""The engine core: sequences, scheduler, block manager, runner, stages, the reference decoder, `LLM`."""
