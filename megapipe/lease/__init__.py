"""What a training job holds of the cluster service: its lease (``client.py``: progress reports, the order
to stop) and the signing both sides of every request share (``auth.py``). Apart from Gavel's core so that a
training process holding a lease imports no scheduler."""
