"""Engine edge cases a reader of dualAR.Scheduler may want to see in one place."""
import torch

import dualAR
from conftest import golden


def test_a_row_that_ends_mid_group_stays_inside_a_fixed_cache(model):
    """With sync_every 4 the host reads frames in groups of 4: a row whose request reaches the end of a
    fixed 256-position cache in the middle of a group runs on at the last position (clamped), never past
    the cache, while a short-prompt request that outlives it goes on. Both get their solo codes."""
    reference = (golden("codec_codes.npy"), "Hello")
    long = dict(text="Good morning, how are you?", references=[reference], seed=1, max_context=256)
    short = dict(text="Hi.", seed=2, max_context=256)
    request = dualAR.Request(model, **long)
    assert (request.frame_budget() - 1) % 4 != 0  # its last frame is not the last of a group
    made = [dualAR.Request(model, **r) for r in (long, short)]
    with dualAR.Scheduler(model, slots=2, context=256, sync_every=4) as scheduler, torch.inference_mode():
        for r in made:
            scheduler.submit(r)
        scheduler.run()
    long_codes, short_codes = (r.codes() for r in made)
    assert long_codes.size(1) == request.frame_budget() - 1 < short_codes.size(1)  # to the cache's end
    assert torch.equal(long_codes, dualAR.generate(model, **long))
    assert torch.equal(short_codes, dualAR.generate(model, **short))
