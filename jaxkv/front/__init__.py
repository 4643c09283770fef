"""The front ends: the command line, JSONL data-set jobs, chat, streaming text, transcription."""
