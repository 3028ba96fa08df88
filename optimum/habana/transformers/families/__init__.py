"""Which families of the installed transformers run the Gaudi attention, read from their code (`qualification`).

Kept free of the model classes, so that the attention, the decoder's plan and the registry can all ask."""
