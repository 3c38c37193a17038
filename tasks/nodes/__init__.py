"""A lab's nodes: where a trial runs (GPU, resource or CPU slots), files crossing nodes by
content, and the preflight that every node runs the same Pomona.
"""
