"""Reading the queue without changing it: counts and listings (the one home of queue counts),
and tracing."""
