"""Flow control: whether a request may start now (admission on the workers' live
capacity), where it waits when it may not (the waiting room, ordered by class and fair
share across gateways), and whether its prompt takes the prefill hop (`prefill_site`)."""
