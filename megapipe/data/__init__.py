"""Data: tokenizers, indexed datasets, GPT/BERT samples, blending, samplers and a built-in corpus.

Import from the modules (this package imports nothing, so tokenizer worker processes start
without loading torch):

- ``tokenizer``: ``build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size)``
- ``indexed_dataset``: the ``.bin``/``.idx`` format, ``IndexedDataset``, ``IndexedDatasetBuilder``
- ``preprocess``: ``preprocess(inputs, output_prefix, tokenizer, ...)`` behind tools/preprocess_data.py
- ``gpt_dataset``, ``bert_dataset``, ``blended_dataset``: the datasets the training loop samples
- ``builder``: ``build_train_valid_test_datasets(kind, data_path, split, seq_length, seed, num_samples, tokenizer)``
- ``samplers``: ``build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size)``
- ``corpus``: ``default_gpt_data()``, ``default_bert_data()``, ``unigram_entropy(prefix)``
"""
