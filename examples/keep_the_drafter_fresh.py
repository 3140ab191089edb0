"""Keep the MTP drafter fresh during training without touching the policy's gradients.

Evaluation records the drafter's acceptance (``+metrics``); an ``AcceptanceController`` trains
MTP with weight 0.3 while the greedy accepted length is below its target and skips it once it
is there, and trains it again when the data shifts and the drafter falls behind. Training
detaches MTP (``+detach``), so the trunk's gradients are exactly those of a
step without MTP. Runs as it is on a CPU with a tiny megatron-core GPTModel (two MTP depths):

    python examples/keep_the_drafter_fresh.py

In a real job, keep your own model, optimizer, data and megatron setup, and the four
mtp-hooks lines (attach, configure, the controller, update).
"""

import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models
from mtp_hooks_drafting import AcceptanceController

torch.manual_seed(0)
tiny_models.init_single_process(port=tiny_models.free_port())  # one gloo rank
tiny_models.reset_mtp_loss_tracker(num_layers=2)  # CPU only: megatron keeps it on CUDA
spec = tiny_models.TinySpec(vocab_size=64, seq_length=32, mtp_num_layers=2)
model = tiny_models.build_gpt(spec, attention="sdpa")
# '+detach' needs it: no global clip mixes MTP into the trunk
mtp_hooks.megatron.clip_mtp_apart(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)


def batch(step):
    """Sequences that count up from a random start, by 1 and from step 40 by 3: the data shifts
    under the drafter, as a policy's outputs do in RL."""
    start = torch.randint(0, spec.vocab_size, (8, 1))
    stride = 1 if step < 40 else 3
    ids = (start + stride * torch.arange(spec.seq_length)) % spec.vocab_size
    pos = torch.arange(spec.seq_length).expand(8, -1)
    return ids, pos, torch.roll(ids, -1, dims=1)


handle = mtp_hooks.attach(model)
mtp_hooks.configure("train=auto+detach,eval=run+metrics,rollout=skip")
controller = AcceptanceController(
    metric="accepted_length",  # mean greedy chain length over both depths
    target=1.5,  # what the drafter should keep (of at most 2)
    below=0.3,  # MTP loss weight while it is below the target
    above=None,  # skip MTP in training once it is there
    window=1,  # decide on the latest evaluation
)
mtp_hooks.plugins.register(controller, name="drafter")  # it also receives every recorded forward

for step in range(1, 81):
    ids, pos, labels = batch(step)
    model.train()
    optimizer.zero_grad()
    model(ids, pos, None, labels=labels).mean().backward()  # MTP detached, weight 0.3, or skipped
    optimizer.step()
    if step % 10 == 0:
        model.eval()
        with torch.no_grad():
            ids, pos, labels = batch(step)
            model(ids, pos, None, labels=labels)  # recorded: feeds the controller
        weight = controller.update()  # the only point where the training decision changes
        decision = mtp_hooks.decide(model, "train")
        print(
            f"step {step:2d}: accepted length {controller.value:.2f}, "
            f"train MTP {'skipped' if not decision.run else f'weight {weight}, detached'}"
        )
print("stats:", handle.stats())
handle.remove()
