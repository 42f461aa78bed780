"""Test infrastructure shipped with the library: worlds of real processes that never hang
(``worlds``), several hosts on one machine (``hosts``) and a pretend accelerator (``fake_device``)."""
