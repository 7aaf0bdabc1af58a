"""The target model: its verification forward (``model``), how it is loaded (``loading``) and the
embedded default target (``default_model``)."""
