"""What the tests share: tiny models, reference decoders, stand-ins and checks, one module per concept.

Test modules import these as ``diffdraft_testing.<module>`` and never import one another: a folder of
tests such as ``tests/kernels`` is no package, so ``from kernels.test_x import ...`` resolves to any
installed package of that name first (transformers pulls in Hugging Face's ``kernels``), and a bare
``from conftest import ...`` or ``from test_x import ...`` depends on the folders pytest puts on
``sys.path``. pytest puts ``tests/`` there (``pythonpath`` in pyproject.toml), and no installed package
takes this package's name; tests/test_test_imports.py keeps it that way.
"""
