"""Fine-tuning OmniVoice, full or LoRA: audio tokens, training, export, one file.

Upstream k2-fsa/OmniVoice 0.2.1's pipeline, on our dependencies: its tar shards of codes, its batches,
losses and updates, bit for bit on CPU fp32 (tests/fixtures/omnivoice-tiny/train is the specification).

    python train_omnivoice.py tokens --input-jsonl data.jsonl --checkpoint CKPT --out tokens/
    python train_omnivoice.py train --train-config T.json --data-config D.json --out runs/me
    python train_omnivoice.py export runs/me --out my-omnivoice     # omnivoice.py --checkpoint my-omnivoice

How the file reads (sections, top to bottom):
    tokens          stage 0: clips -> codes in upstream's tar shards + label JSONL + data.lst
    data            stage 1's batches: shard and sample shuffles, the processor's draws, length buckets,
                    padding, loader workers in turn
    model           the trainable model: LoRA (peft's init and names), the loss per codebook
    optimizer       AdamW, global-norm clipping, the cosine schedule with warm-up, accumulation
    run             configs (upstream's JSON), the run folder, checkpoints, --resume, several processes
    export          merged checkpoint folder, peft-format adapter
    CLI             tokens / train / export
"""

# ----------------------------------------------------------------------------- tokens


# ----------------------------------------------------------------------------- data


# ----------------------------------------------------------------------------- model


# ----------------------------------------------------------------------------- optimizer


# ----------------------------------------------------------------------------- run


# ----------------------------------------------------------------------------- export


# ----------------------------------------------------------------------------- CLI
