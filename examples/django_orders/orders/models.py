from django.db import models


class Order(models.Model):
    sku = models.CharField(max_length=40)


class Confirmation(models.Model):
    """One row per run of ``send_confirmation``: what the tests count."""

    order_id = models.BigIntegerField()
