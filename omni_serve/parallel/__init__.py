"""Parallel building blocks of stages wider than one worker: a step's rows split across ranks
(``omni_serve.parallel.rows``) and diffusers' context (sequence) parallelism made to run on CPU ranks
(``omni_serve.parallel.context``). Each works inside an initialized ``torch.distributed`` group (NCCL on GPU, gloo
on CPU) whose every rank holds the same model and runs the same call; each is exact against one rank."""
