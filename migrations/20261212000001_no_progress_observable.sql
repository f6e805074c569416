-- `progress_observable` was stored with every step and read by nothing: renewal rests on the
-- worker being alive, and the attempt deadline and the adapter timeout bound every call. The
-- API no longer has it (its field number is reserved) and z29c no longer writes it. The
-- column stays, with a default, while executors of the previous release may still be
-- claiming (they read it); a later release drops it.
ALTER TABLE steps ALTER COLUMN progress_observable SET DEFAULT false;
