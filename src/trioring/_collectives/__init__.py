"""The collectives, one module per family: its argument checks and the call into the
algorithm that the decision table (:mod:`._decision`) picked. The Communicator validates
through them, picks through the table and runs the result in its own sequencing."""
